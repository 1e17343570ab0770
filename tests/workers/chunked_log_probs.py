"""The policy's GRPO loss and an inference pass, each run twice on the same weights: from whole
logits (logprob_chunk_tokens 0) and a few tokens at a time (3: chunks that cut rows), for each layout
named in the arguments ("tp1", "tp2", "pp2"; tied embeddings with "+tied"), fp32: the log-probs, the
entropy and the loss of two optimizer steps, and every gradient of the first."""

import torch
from common import ARGS, save, setup, tiny_arch
from tests.workers.findings import ChunkedLogProbs, ChunkedRun

from megatron_rlhf.config.schema import PPOConfig, RoleConfig
from megatron_rlhf.models.decoder import build_model, unwrap
from megatron_rlhf.models.pipeline import forward_backward
from megatron_rlhf.models.training import train_step, wrap_for_training
from megatron_rlhf.models.vocab_parallel import next_token_log_probs, reads_chunked
from megatron_rlhf.roles.losses import policy_loss_fn

TEMPERATURE = 0.7


def micro_batches(vocab_size: int):
    data = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab_size, (4, 11), generator=data)
    mask = (torch.rand(4, 10, generator=data) > 0.2).float()
    return [{"tokens": tokens[i : i + 2], "action_mask": mask[i : i + 2],
             "old_log_probs": -torch.rand(2, 10, generator=data) * 4,
             "advantages": torch.randn(2, 10, generator=data)} for i in (0, 2)]


def run(layout: str, chunk: int) -> ChunkedRun:
    tp, pp = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}[layout.split("+")[0]]
    arch = tiny_arch(tie_word_embeddings=layout.endswith("+tied"))
    parallel = setup(tp, pp, seed=11)  # the same initial weights in both runs
    model = build_model(arch, parallel, "lm", precision="fp32", logprob_chunk_tokens=chunk)
    mbs = micro_batches(arch.vocab_size)

    @reads_chunked
    def reduce(output, mb):
        return next_token_log_probs(output, mb, arch.vocab_size, TEMPERATURE)

    inference = [o["output"] for o in forward_backward(model, mbs, reduce=reduce)]
    ddp, optimizer = wrap_for_training(model, RoleConfig(precision="fp32", lr=1e-4, clip_grad=0.0))
    loss_fn = policy_loss_fn(arch.vocab_size, TEMPERATURE, PPOConfig())
    first = train_step(ddp, optimizer, mbs, loss_fn)
    grads = {n: p.main_grad.detach().clone() for n, p in unwrap(ddp).named_parameters()}
    second = train_step(ddp, optimizer, mbs, loss_fn)
    metrics = [{k: float(v) for k, v in m.items()} for step in (first, second) for m in step["metrics"]]
    return ChunkedRun(inference=inference, metrics=metrics, grad_norms=[float(first["grad_norm"]),
                      float(second["grad_norm"])], grads=grads,
                      chunked=getattr(unwrap(ddp), "logprob_chunk_tokens", None))


save(ChunkedLogProbs(runs={(layout, chunk): run(layout, chunk) for layout in ARGS for chunk in (0, 3)}))
