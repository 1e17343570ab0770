"""LoRA adapters (models/lora.py) on the tiny model, run with 2 processes: at TP=1 the adapters with
B = 0 give the base's logits exactly, and with random B the logits of the base with the adapters
merged into its weights (W + alpha/rank B A, each projection's); at TP=2 and PP=2 (the base loaded from the TP=1
model's shards, B from the same full tensors) the same logits and, gathered, the same adapter
gradients; A starts the same at every layout. Writes the base and each layout's base and adapters
as model checkpoints (for the export tests against transformers and peft). Saves the differences
and the TP=1 logits."""

import os


import torch
from common import OUT_DIR, save, setup, tiny_arch
from tests.workers.findings import LoRA
from megatron.core import parallel_state as ps

from megatron_rlhf.config.names import LORA_TARGETS
from megatron_rlhf.checkpoint.hf_decoder import _qkv_from_hf, _qkv_to_hf
from megatron_rlhf.checkpoint.model_files import save_shard, write_model_meta
from megatron_rlhf.models.decoder import build_model, load_local_state_dict, local_state_dict
from megatron_rlhf.models.lora import add_adapters, adapters_off, is_adapter
from megatron_rlhf.models.pipeline import forward_backward, gather_vocab_parallel
from megatron_rlhf.models.sharding import merge_state_dicts, shard_state_dict
from megatron_rlhf.runtime import get_platform

RANK, ALPHA, SEED = 4, 8.0, 7
arch = tiny_arch(vocab_size=100)
gen = torch.Generator().manual_seed(0)
device = get_platform().device
micro_batches = [{"tokens": torch.randint(0, 100, (2, 12), generator=gen).to(device)} for _ in range(2)]
weights = torch.randn(2, 2, 12, 100, generator=gen).to(device)  # d(loss)/d(logits): a fixed random direction


def logits(model):
    out = forward_backward(model, micro_batches)
    return None if not out else torch.stack([gather_vocab_parallel(o["output"])[..., : arch.vocab_size] for o in out])


def loss_fn(output, mb):
    full = gather_vocab_parallel(output)[..., : arch.vocab_size]
    index = next(i for i, m in enumerate(micro_batches) if m is mb)
    loss = (full.float() * weights[index]).sum()
    return loss, torch.tensor(1), {"loss": loss.detach()}


def gathered(state: dict, tp: int, pp: int) -> dict:
    """This rank's tensors (local names) of every rank, merged into the full dict."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                                                   {k: v.detach().cpu() for k, v in state.items()}))
    shards = [[next(s for p, t, s in everyone if (p, t) == (pp_rank, tp_rank)) for tp_rank in range(tp)]
              for pp_rank in range(pp)]
    return merge_state_dicts(shards, arch.num_layers, arch.vocab_size, "lm")


def write_checkpoint(model, name: str, tp: int, pp: int, lora: bool) -> None:
    """Every rank's shard of ``model`` into OUT_DIR/name, as a model checkpoint."""
    root = os.path.join(OUT_DIR, name)
    state = {k: v.detach().cpu() for k, v in local_state_dict(model).items()}
    save_shard(root, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), pp, state)
    if torch.distributed.get_rank() == 0:
        write_model_meta(root, arch, "lm", torch.float32, tp, pp,
                         {"rank": RANK, "alpha": ALPHA, "target_modules": list(LORA_TARGETS)} if lora else None)
    torch.distributed.barrier()


result = LoRA.to_fill()
result.a_init, result.logits, result.grads = {}, {}, {}
parallel = setup(1, 1)
model = build_model(arch, parallel, "lm")
base = merge_state_dicts([[{k: v.detach().cpu().clone() for k, v in local_state_dict(model).items()}]],
                         arch.num_layers, arch.vocab_size, "lm")
base_logits = logits(model)
write_checkpoint(model, "base", 1, 1, lora=False)
add_adapters(model, RANK, ALPHA, LORA_TARGETS, SEED)
result.b0_equal = torch.equal(logits(model), base_logits)
full = merge_state_dicts([[{k: v.detach().cpu().clone() for k, v in local_state_dict(model).items()}]],
                         arch.num_layers, arch.vocab_size, "lm")
b_gen = torch.Generator().manual_seed(1)
for name in sorted(full):
    if name.endswith("lora_b"):
        full[name] = torch.randn(full[name].shape, generator=b_gen) * 0.1
load_local_state_dict(model, shard_state_dict(full, arch.num_layers, arch.padded_vocab_size(1), 1, 0))
lora_logits = logits(model)
result.lora_logits = lora_logits.cpu()
result.tokens = torch.stack([mb["tokens"] for mb in micro_batches]).cpu()
with adapters_off(model):
    result.off_equal = torch.equal(logits(model), base_logits)
result.lora_moves = (lora_logits - base_logits).abs().max().item()
# The adapters merged into the base: W + alpha/rank x B A, projection by projection as Hugging Face
# names them (a fused linear's A stacks its projections' A's; its B has the weight's rows).
merged = {k: v.clone() for k, v in base.items()}
for name in full:
    if name.endswith("lora_a"):
        linear = name[: -len(".lora_a")]
        a, b = full[name], full[linear + ".lora_b"]
        if linear.endswith("linear_qkv"):
            delta = _qkv_from_hf(*(bp @ ap for bp, ap in zip(_qkv_to_hf(b, arch), a.chunk(3))), arch)
        elif linear.endswith("linear_fc1"):
            delta = torch.cat([bp @ ap for bp, ap in zip(b.chunk(2), a.chunk(2))])
        else:
            delta = b @ a
        merged[linear + ".weight"] += ALPHA / RANK * delta
plain = build_model(arch, parallel, "lm")
load_local_state_dict(plain, shard_state_dict(merged, arch.num_layers, arch.padded_vocab_size(1), 1, 0))
result.merged = (logits(plain) - lora_logits).abs().max().item()
del plain
forward_backward(model, micro_batches, loss_fn, forward_only=False)
grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if is_adapter(n)}
result.base_without_grads = all(p.grad is None for n, p in model.named_parameters() if not is_adapter(n))
reference_grads = merge_state_dicts([[grads]], arch.num_layers, arch.vocab_size, "lm")
del model

for tp, pp in ((2, 1), (1, 2)):
    parallel = setup(tp, pp)
    model = build_model(arch, parallel, "lm")
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    load_local_state_dict(model, shard_state_dict(base, arch.num_layers, arch.padded_vocab_size(tp), tp, tp_rank, pp, pp_rank))
    add_adapters(model, RANK, ALPHA, LORA_TARGETS, SEED)
    start = gathered({k: v for k, v in local_state_dict(model).items() if k.endswith("lora_a")}, tp, pp)
    key = f"tp{tp}_pp{pp}"
    result.a_init[key] = all(torch.equal(start[k], full[k]) for k in start) and len(start) == 4 * arch.num_layers
    load_local_state_dict(model, shard_state_dict(full, arch.num_layers, arch.padded_vocab_size(tp), tp, tp_rank, pp, pp_rank))
    write_checkpoint(model, f"lora_{key}", tp, pp, lora=True)
    got = logits(model)
    result.logits[key] = None if got is None else (got - lora_logits).abs().max().item()
    forward_backward(model, micro_batches, loss_fn, forward_only=False)
    mine = gathered({n: p.grad for n, p in model.named_parameters() if is_adapter(n)}, tp, pp)
    result.grads[key] = max(((mine[k] - reference_grads[k]).abs().max() / reference_grads[k].abs().max()).item()
                            for k in reference_grads)
    del model
save(result)
