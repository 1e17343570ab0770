"""TP/PP/SP models loaded with shards of one full model give the full model's outputs (fp32),
for both heads; and a bf16 TP2xPP2 model trains (loss falls). Run with 4 processes."""

import torch
from common import ARGS, save, setup, tiny_arch
from tests.workers.findings import ModelsEquivalence
from megatron.core import parallel_state as ps

from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.models.decoder import build_model, load_local_state_dict, local_state_dict
from megatron_rlhf.models.pipeline import forward_backward, gather_vocab_parallel
from megatron_rlhf.models.sharding import merge_state_dicts, shard_state_dict
from megatron_rlhf.models.training import next_token_loss, train_step, wrap_for_training
from megatron_rlhf.runtime import get_platform

arch = tiny_arch(vocab_size=100)  # not a multiple of the padding: exercises vocab padding
gen = torch.Generator().manual_seed(0)
device = get_platform().device
micro_batches = [{"tokens": torch.randint(0, 100, (2, 12), generator=gen).to(device)} for _ in range(2)]
LAYOUTS = [(2, 1, False), (1, 2, False), (2, 2, False)]
if ARGS and ARGS[0] == "sp":  # sequence parallel needs transformer-engine (GPU)
    LAYOUTS.append((2, 1, True))


def outputs(model, head):
    out = forward_backward(model, micro_batches)
    if not out:
        return None
    full = [o["output"] for o in out]
    if head == "lm":
        full = [gather_vocab_parallel(o)[..., : arch.vocab_size] for o in full]
    return torch.stack(full)


def local_state(model):
    return {k: v.detach().cpu().clone() for k, v in local_state_dict(model).items()}


result = ModelsEquivalence.to_fill()
result.errors, result.round_trips = {}, {}
for head in ("lm", "scalar"):
    parallel = setup(1, 1)
    reference_model = build_model(arch, parallel, head)
    full = local_state(reference_model)
    full = merge_state_dicts([[full]], arch.num_layers, arch.vocab_size, head)
    reference = outputs(reference_model, head)
    del reference_model
    for tp, pp, sp in LAYOUTS:
        parallel = setup(tp, pp, sp)
        model = build_model(arch, parallel, head)
        shard = shard_state_dict(
            full, arch.num_layers, arch.padded_vocab_size(tp), tp, ps.get_tensor_model_parallel_rank(),
            pp, ps.get_pipeline_model_parallel_rank(), head=head,
        )
        load_local_state_dict(model, shard)
        got = outputs(model, head)
        key = (head, f"tp{tp}_pp{pp}" + ("_sp" if sp else ""))
        result.errors[key] = None if got is None else (got - reference).abs().max().item()
        # Shards gathered back from every rank rebuild the full state dict exactly.
        mine = local_state(model)
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), mine))
        grid = [[None] * tp for _ in range(pp)]
        for p, t, sd in gathered:
            grid[p][t] = sd
        merged = merge_state_dicts(grid, arch.num_layers, arch.vocab_size, head)
        result.round_trips[key] = sorted(merged) == sorted(full) and all(torch.equal(merged[k], full[k]) for k in full)

# bf16 forward/backward under TP2xPP2 with the distributed optimizer: the loss must fall.
parallel = setup(2, 2)
model = build_model(arch, parallel, "lm", precision="bf16")
ddp, optimizer = wrap_for_training(model, RoleConfig(precision="bf16", lr=1e-2))




losses = []
for _ in range(4):
    step = train_step(ddp, optimizer, micro_batches, next_token_loss)
    if step["metrics"]:
        losses.append(torch.stack([m["loss"] for m in step["metrics"]]).mean().item())
result.bf16_losses = losses
result.bf16_param_dtype = str(next(ddp.parameters()).dtype)
save(result)
