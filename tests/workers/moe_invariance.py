"""The PPO policy update of a tiny Qwen3-MoE (4 experts, top-2, a dense first layer) under several
ways of cutting the work. Args: "single" (1 process: the uncut run, one micro-batch of all 8 rows,
against micro-batches of 1 and 4) or "layouts" (2 processes: DP=2, DP=2 x EP=2, PP=2), each
without the load-balancing loss and with it (coefficient 0.1, megatron's per-micro-batch "aux_loss").
Saves per case the full gradients after the step's backward (every expert under its global number)
and the reported loss and load-balancing loss."""

import torch
from common import ARGS, save, setup, tiny_arch
from tests.workers.findings import MoEInvariance, UpdateStep
from megatron.core import parallel_state as ps

from megatron_rlhf.config.schema import PPOConfig, RoleConfig
from megatron_rlhf.models.batches import action_mask, length_grouped, split_rows
from megatron_rlhf.models.decoder import build_model, load_local_state_dict, local_state_dict, unwrap
from megatron_rlhf.models.pipeline import forward_backward
from megatron_rlhf.models.sharding import experts_of_rank, experts_renumbered, merge_state_dicts, shard_state_dict
from megatron_rlhf.models.training import moe_losses, wrap_for_training
from megatron_rlhf.roles.losses import policy_loss_fn, policy_stats, reported_metrics

ROWS, WIDTH = 8, 20
ARCH = tiny_arch(family="qwen3_moe", qk_norm=True, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                 moe_dense_layers=[0])
gen = torch.Generator().manual_seed(5)
prompt_lengths = torch.randint(2, 6, (ROWS,), generator=gen)
response_lengths = torch.tensor([1, 14, 3, 9, 2, 12, 5, 7])
rollout = {
    "tokens": torch.randint(3, ARCH.vocab_size, (ROWS, WIDTH), generator=gen),
    "action_mask": action_mask(WIDTH, prompt_lengths, response_lengths),
    "old_log_probs": -1.0 - 3.0 * torch.rand(ROWS, WIDTH - 1, generator=gen),
    "ref_log_probs": -1.0 - 3.0 * torch.rand(ROWS, WIDTH - 1, generator=gen),
    "advantages": torch.randn(ROWS, WIDTH - 1, generator=gen),
}


def full_weights(arch):
    parallel = setup(1, 1, seed=11)
    state = {k: v.detach().clone() for k, v in local_state_dict(build_model(arch, parallel, "lm")).items()}
    return merge_state_dicts([[state]], arch.num_layers, arch.vocab_size)


def full_grads(ddp, arch, pp):
    """Every rank's main grads as full tensors: dense ones from DP rank 0, each expert from the EP
    rank that holds it."""
    named = {n: p.main_grad.detach().clone() for n, p in unwrap(ddp).named_parameters()}
    named = experts_renumbered(named, arch.num_experts, ps.get_expert_model_parallel_world_size(),
                               ps.get_expert_model_parallel_rank())
    mine = (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(), named)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    stages = [{} for _ in range(pp)]
    for p, d, grads in everyone:
        stages[p].update({k: v for k, v in grads.items() if d == 0 or ".local_experts." in k})
    return merge_state_dicts([[s] for s in stages], arch.num_layers, arch.vocab_size)


def one_step(arch, weights, pp, ep, micro):
    parallel = setup(1, pp, seed=11, ep=ep)
    model = build_model(arch, parallel, "lm")
    shard = shard_state_dict(weights, arch.num_layers, arch.padded_vocab_size(1), 1, 0, pp,
                             ps.get_pipeline_model_parallel_rank())
    load_local_state_dict(model, experts_of_rank(shard, arch.num_experts, ep, ps.get_expert_model_parallel_rank()))
    ddp, _ = wrap_for_training(model, RoleConfig(precision="fp32", use_distributed_optimizer=False))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = {k: v.chunk(dp)[dp_rank] for k, v in rollout.items()}
    lengths = (prompt_lengths + response_lengths).chunk(dp)[dp_rank]
    config = PPOConfig(loss_agg_mode="token-mean", kl_in_loss=True, kl_estimator="low_var_kl", clip_ratio_high=0.28)
    ddp.zero_grad_buffer()
    uncut = (pp, ep, dp, micro) == (1, 1, 1, ROWS)
    micro_batches = split_rows(micro, **mine) if uncut else length_grouped(micro, lengths, **mine)[0]
    metrics = forward_backward(ddp, micro_batches, policy_loss_fn(arch.vocab_size, 1.0, config, kl_coef=0.1),
                               forward_only=False)
    reported = reported_metrics([metrics], "policy", policy_stats(config), torch.device("cpu"), ps.get_data_parallel_group())
    return UpdateStep(grads=full_grads(ddp, arch, pp), loss=reported["loss/policy"], moe=moe_losses(ddp, len(micro_batches)))


result = MoEInvariance(steps={})
for coeff in (0.0, 0.1):
    arch = tiny_arch(**{**ARCH.__dict__, "moe_aux_loss_coeff": coeff, "moe_z_loss_coeff": coeff / 10})
    weights = full_weights(arch)
    if ARGS[0] == "single":
        for micro in (8, 1, 4):
            result.steps[(coeff, f"mb{micro}")] = one_step(arch, weights, 1, 1, micro)
    else:
        for name, pp, ep, micro in (("dp2", 1, 1, 2), ("ep2", 1, 2, 2), ("pp2", 2, 1, 2)):
            result.steps[(coeff, name)] = one_step(arch, weights, pp, ep, micro)
save(result)
