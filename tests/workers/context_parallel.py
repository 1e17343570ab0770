"""Context parallelism (models/context_parallel.py) and packed rows (models/packed_rows.py) against
CP=1's padded rows, fp32, on the same weights and rows
(rows of 13 tokens, right-padded: 13 is no multiple of 2 x CP, so the chunks are padded too): a policy's
forward-only log-probs (chunked, 4 tokens at a time) and two optimizer steps of GRPO's loss with the KL
in it and of GSPO's (a mean over sequences), a value head's values and two steps of the value loss
(each sequence's token sum), and two steps of SFT's loss, for each
layout named in the arguments ("cp1", "cp2", "cp4" or "packed", with "+tp2" or "+pp2"; "+window" for a
sliding window of 5; "+experts" for a model with experts, its routing recorded by the forward-only
pass and replayed by GRPO's); and of a reward model's Bradley-Terry loss and DPO's (IPO, length-normalised, with the
NLL), each micro-batch's two rows a pair: losses of whole sequences, summed over the CP ranks. The
run's figures are each step's metric sums over every rank's rows (DP replicas counted once)."""

import torch
from common import ARGS, save, setup, tiny_arch
from tests.workers.findings import ContextParallel, ContextParallelRun

from megatron_rlhf.config.schema import DPOConfig, PPOConfig, RMConfig, RoleConfig
from megatron_rlhf.models.decoder import build_model, unwrap
from megatron_rlhf.models.pipeline import broadcast_from_last_stage, forward_backward, sum_over
from megatron_rlhf.models.training import train_step, wrap_for_training
from megatron_rlhf.models.vocab_parallel import next_token_log_probs, reads_chunked
from megatron_rlhf.models import routing
from megatron_rlhf.models.batches import ROW_LENGTHS, state_values
from megatron_rlhf.roles.losses import policy_loss_fn, value_loss_fn
from megatron_rlhf.stages.losses import dpo_loss_fn, reward_loss_fn, sft_loss_fn

ROWS, WIDTH = 4, 13


def micro_batches(vocab_size: int):
    data = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab_size, (ROWS, WIDTH), generator=data)
    lengths = torch.tensor([13, 9, 12, 6])
    mask = ((torch.arange(1, WIDTH) >= 3) & (torch.arange(1, WIDTH) < lengths[:, None])).float()
    columns = {"tokens": tokens, "action_mask": mask, "old_log_probs": -torch.rand(ROWS, WIDTH - 1, generator=data) * 4,
               "ref_log_probs": -torch.rand(ROWS, WIDTH - 1, generator=data) * 4,
               "advantages": torch.randn(ROWS, WIDTH - 1, generator=data),
               "old_values": torch.randn(ROWS, WIDTH - 1, generator=data),
               "returns": torch.randn(ROWS, WIDTH - 1, generator=data),
               "last_index": lengths - 1, ROW_LENGTHS: lengths, "ref_logps": -torch.rand(ROWS, generator=data) * 20}
    margins = torch.randn(ROWS // 2, generator=data)
    return [{**{k: v[i : i + 2] for k, v in columns.items()}, "margin": margins[i // 2 : i // 2 + 1]} for i in (0, 2)]


# each loss's figures: the metric sums compared
FIGURES = {"grpo": ("loss", "loss_count", "tokens"), "value": ("loss", "loss_count", "tokens"),
           "gspo": ("loss", "loss_count", "tokens", "approx_kl"),
           "sft": ("loss", "loss_count", "tokens"), "rm": ("loss", "loss_count", "pairs", "accuracy", "reward/mean"),
           "dpo": ("loss", "loss_count", "pairs", "nll", "chosen_tokens", "rewards/margins")}


def step_figures(metrics: list, model, names) -> dict:
    """A step's metric sums ``names`` over its micro-batches and every rank's share of the rows."""
    from megatron.core import parallel_state as ps

    groups = unwrap(model).pg_collection
    local = torch.tensor([sum(float(m[k]) for m in metrics) for k in names], dtype=torch.float64) if metrics else None
    local = broadcast_from_last_stage(local, (len(names),), torch.float64, "cpu", groups.pp)
    total = sum_over(local, ps.get_data_parallel_group(with_context_parallel=True)) / ps.get_data_parallel_world_size()
    return dict(zip(names, total.tolist()))


def trained(arch, parallel, head: str, loss_fn, mbs, chunk: int, names, packs: bool):
    """Two optimizer steps: each step's figures and grad norm, the first step's grads, the last weights."""
    model = build_model(arch, parallel, head, precision="fp32", logprob_chunk_tokens=chunk, pack_rows=packs)
    if arch.num_experts:
        routing.enable(model)
    ddp, optimizer = wrap_for_training(model, RoleConfig(precision="fp32", lr=1e-4, clip_grad=0.0,
                                                         use_distributed_optimizer=False))
    figures, norms, grads = [], [], None
    for _ in range(2):
        result = train_step(ddp, optimizer, mbs, loss_fn)
        figures.append(step_figures(result["metrics"], ddp, names))
        norms.append(float(result["grad_norm"]))
        if grads is None:
            grads = {n: p.main_grad.detach().clone() for n, p in unwrap(ddp).named_parameters()}
    weights = {n: p.detach().clone() for n, p in unwrap(ddp).named_parameters()}
    return figures, norms, grads, weights


def run(layout: str) -> ContextParallelRun:
    parts = layout.split("+")
    packs = parts[0] == "packed"
    cp = 1 if packs else int(parts[0][2:])
    tp, pp = (2 if "tp2" in parts else 1), (2 if "pp2" in parts else 1)
    experts = dict(family="qwen3_moe", qk_norm=True, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                   moe_norm_topk_prob=True) if "experts" in parts else {}
    arch = tiny_arch(sliding_window=5 if "window" in parts else None, **experts)
    mbs = micro_batches(arch.vocab_size)
    figures, norms, grads, weights = {}, {}, {}, {}
    parallel = setup(tp, pp, seed=11, cp=cp)  # the same initial weights at every layout
    policy = build_model(arch, parallel, "lm", precision="fp32", logprob_chunk_tokens=4, pack_rows=packs)

    @reads_chunked
    def log_probs(output, mb):
        return next_token_log_probs(output, mb, arch.vocab_size, 0.7)

    value = build_model(arch, parallel, "scalar", precision="fp32", pack_rows=packs)
    values = [o["output"] for o in forward_backward(value, mbs, reduce=lambda output, mb: state_values(output, mb))]
    if experts:  # the routing recorded here is replayed by GRPO's steps
        routing.enable(policy)
        routes = []
        inferred = [o["output"] for o in forward_backward(policy, mbs, reduce=log_probs, routes_out=routes)]
        mbs = [{**mb, routing.ROUTES: r} for mb, r in zip(mbs, routes)]
    else:
        inferred = [o["output"] for o in forward_backward(policy, mbs, reduce=log_probs)]
    losses = {"grpo": ("lm", policy_loss_fn(arch.vocab_size, 0.7, PPOConfig(kl_in_loss=True), kl_coef=0.1), 4),
              "value": ("scalar", value_loss_fn(0.2, "seq-mean-token-sum"), 0),
              "gspo": ("lm", policy_loss_fn(arch.vocab_size, 0.7, PPOConfig(policy_loss="gspo", clip_ratio_low=3e-4,
                                                                            clip_ratio_high=4e-4,
                                                                            loss_agg_mode="seq-mean-token-mean")), 4),
              "sft": ("lm", sft_loss_fn(arch.vocab_size), 0),
              "rm": ("scalar", reward_loss_fn(RMConfig(center_rewards_coefficient=0.01)), 0),
              "dpo": ("lm", dpo_loss_fn(arch.vocab_size, DPOConfig(loss_type="ipo", nll_coef=0.5), nll_scale=0.2), 4)}
    # beside TP or PP half of the losses each (the test's time); alone every one; with experts GRPO's
    chosen = ("grpo",) if experts else ("grpo", "value", "dpo") if tp > 1 else ("gspo", "sft", "rm") if pp > 1 \
        else tuple(losses)
    for name in chosen:
        head, loss_fn, chunk = losses[name]
        setup(tp, pp, seed=11, cp=cp)
        figures[name], norms[name], grads[name], weights[name] = trained(arch, parallel, head, loss_fn, mbs, chunk,
                                                                         FIGURES[name], packs)
    return ContextParallelRun(log_probs=inferred, values=values, figures=figures, grad_norms=norms, grads=grads,
                              weights=weights)


save(ContextParallel(runs={layout: run(layout) for layout in ARGS}))
