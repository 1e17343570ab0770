"""The PPO update of one synthetic rollout under several ways of cutting the work. Args: "single"
(1 process: the uncut run, one micro-batch of all 8 rows, against micro-batches of 1 and 4, for
every loss_agg_mode, and GSPO with dual-clip) or "layouts" (2 processes: DP=2, TP=2, PP=2, token-mean). The policy loss
is the GRPO-style one: the KL to the reference in the loss (low_var_kl) and clip-higher. Saves, per case,
the full gradients of ppo_policy (LM head) and ppo_value (scalar head) after the step's backward
(megatron's finalize has scaled them) and the reported losses."""

import torch
from common import ARGS, save, setup, tiny_arch
from tests.workers.findings import PPOInvariance, UpdateStep
from megatron.core import parallel_state as ps

from megatron_rlhf import ppo
from megatron_rlhf.config.schema import PPOConfig, RoleConfig
from megatron_rlhf.models.batches import action_mask, length_grouped, split_rows, token_packed
from megatron_rlhf.models.decoder import build_model, load_local_state_dict, local_state_dict, unwrap
from megatron_rlhf.models.pipeline import forward_backward
from megatron_rlhf.models.sharding import merge_state_dicts, shard_state_dict, to_local_layer_names
from megatron_rlhf.models.training import wrap_for_training
from megatron_rlhf.roles.losses import policy_loss_fn, policy_stats, reported_metrics, value_loss_fn

ROWS, WIDTH = 8, 20
arch = tiny_arch()
gen = torch.Generator().manual_seed(5)
prompt_lengths = torch.randint(2, 6, (ROWS,), generator=gen)
response_lengths = torch.tensor([1, 14, 3, 9, 2, 12, 5, 7])  # spread, so micro-batches hold unequal token counts
tokens = torch.randint(3, arch.vocab_size, (ROWS, WIDTH), generator=gen)
rollout = {
    "tokens": tokens,
    "action_mask": action_mask(WIDTH, prompt_lengths, response_lengths),
    "old_log_probs": -1.0 - 3.0 * torch.rand(ROWS, WIDTH - 1, generator=gen),
    "ref_log_probs": -1.0 - 3.0 * torch.rand(ROWS, WIDTH - 1, generator=gen),
    "advantages": torch.randn(ROWS, WIDTH - 1, generator=gen),
    "old_values": torch.randn(ROWS, WIDTH - 1, generator=gen),
    "returns": torch.randn(ROWS, WIDTH - 1, generator=gen),
}
POLICY_KEYS = ("tokens", "action_mask", "old_log_probs", "ref_log_probs", "advantages")
VALUE_KEYS = ("tokens", "action_mask", "old_values", "returns")


def full_weights(head):
    """The one set of full weights every layout starts from (TP=1 CPU initialisation, seeded)."""
    parallel = setup(1, 1, seed=11)
    model = build_model(arch, parallel, head)
    state = {k: v.detach().clone() for k, v in local_state_dict(model).items()}
    return merge_state_dicts([[state]], arch.num_layers, arch.vocab_size, head)


def full_grads(ddp, head, tp, pp):
    """Every rank's main grads, merged into full tensors (on every rank)."""
    named = {n: p.main_grad.detach().clone() for n, p in unwrap(ddp).named_parameters()}
    mine = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(),
            to_local_layer_names(named))
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    grid = [[None] * tp for _ in range(pp)]
    for p, t, d, grads in everyone:
        if d == 0:
            grid[p][t] = grads
    return merge_state_dicts(grid, arch.num_layers, arch.vocab_size, head)


def one_step(weights, head, tp, pp, micro, mode):
    parallel = setup(tp, pp, seed=11)
    model = build_model(arch, parallel, head)
    load_local_state_dict(model, shard_state_dict(
        weights, arch.num_layers, arch.padded_vocab_size(tp), tp, ps.get_tensor_model_parallel_rank(),
        pp, ps.get_pipeline_model_parallel_rank(), head=head))
    ddp, _ = wrap_for_training(model, RoleConfig(precision="fp32", use_distributed_optimizer=False))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    keys = POLICY_KEYS if head == "lm" else VALUE_KEYS
    mine = {k: rollout[k].chunk(dp)[dp_rank] for k in keys}
    lengths = (prompt_lengths + response_lengths).chunk(dp)[dp_rank]
    if head == "lm":
        config = PPOConfig(loss_agg_mode=mode, kl_in_loss=True, kl_estimator="low_var_kl", clip_ratio_high=0.28)
        if mode == "gspo+dual-clip":
            config = PPOConfig(loss_agg_mode="seq-mean-token-mean", policy_loss="gspo", clip_ratio_c=3.0,
                               kl_in_loss=True, kl_estimator="low_var_kl")
        loss_fn, stats = policy_loss_fn(arch.vocab_size, 1.0, config, kl_coef=0.1, loss_norm=WIDTH), policy_stats(config)
    else:
        loss_fn, stats = value_loss_fn(0.2, mode, loss_norm=WIDTH), ("clipfrac",)
    ddp.zero_grad_buffer()
    # The uncut run feeds whole rows; every cut run groups rows by length, trimmed (models/batches.py).
    uncut = (tp, pp, micro) == (1, 1, ROWS)
    if isinstance(micro, str):  # micro-batches packed by tokens ("tokens40": 40 per micro-batch)
        micro_batches = token_packed(int(micro[len("tokens"):]), lengths, equal_rows=pp > 1, **mine)[0]
    else:
        micro_batches = split_rows(micro, **mine) if uncut else length_grouped(micro, lengths, **mine)[0]
    metrics = forward_backward(ddp, micro_batches, loss_fn, forward_only=False)
    prefix = "policy" if head == "lm" else "value"
    reported = reported_metrics([metrics], prefix, stats, torch.device("cpu"), ps.get_data_parallel_group())
    return UpdateStep(grads=full_grads(ddp, head, tp, pp), loss=reported[f"loss/{prefix}"])


result = PPOInvariance(steps={})
for head in ("lm", "scalar"):
    weights = full_weights(head)
    if ARGS[0] == "single":
        for mode in ppo.LOSS_AGG_MODES + (("gspo+dual-clip",) if head == "lm" else ()):
            for micro in (8, 1, 4):
                result.steps[(head, mode, f"mb{micro}")] = one_step(weights, head, 1, 1, micro, mode)
            if mode == "token-mean":
                result.steps[(head, mode, "tokens40")] = one_step(weights, head, 1, 1, "tokens40", mode)
    else:
        for name, tp, pp, micro in (("dp2", 1, 1, 2), ("tp2", 2, 1, 4), ("pp2", 1, 2, 2), ("pp2_tokens40", 1, 2, "tokens40")):
            result.steps[(head, "token-mean", name)] = one_step(weights, head, tp, pp, micro, "token-mean")
save(result)
