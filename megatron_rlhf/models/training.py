"""Trainable models: megatron DDP (contiguous grad buffer), the megatron optimizer (distributed or
not), and one optimizer step over a list of micro-batches."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.models import routing
from megatron_rlhf.models.batches import at_actions, next_tokens
from megatron_rlhf.models.decoder import groups_of, unwrap
from megatron_rlhf.runtime import megatron_compat as compat
from megatron_rlhf.runtime.platform import get_platform
from megatron_rlhf.models.pipeline import LossFn, MicroBatch, forward_backward


def wrap_for_training(model: torch.nn.Module, role: RoleConfig) -> Tuple[torch.nn.Module, Any]:
    """Wrap ``model`` in megatron DDP and build its optimizer. Returns (ddp_model, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = unwrap(model).config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=role.overlap_grad_reduce,
        use_distributed_optimizer=role.use_distributed_optimizer,
        nccl_ub=role.nccl_ub,
    )
    ddp_model = DistributedDataParallel(config, ddp_config, model)
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=role.lr,
        min_lr=role.min_lr,
        weight_decay=role.weight_decay,
        adam_beta1=role.adam_beta1,
        adam_beta2=role.adam_beta2,
        adam_eps=role.adam_eps,
        clip_grad=role.clip_grad,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=role.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(optimizer_config, [ddp_model])
    # Megatron builds param groups with max_lr/min_lr for its scheduler; without one, set lr here.
    for group in optimizer.param_groups:
        group["lr"] = role.lr
    compat.wire_grad_sync(config, ddp_model, role.overlap_grad_reduce)
    return ddp_model, optimizer


def train_step(
    ddp_model: torch.nn.Module, optimizer: Any, micro_batches: List[MicroBatch], loss_fn: LossFn
) -> Dict[str, Any]:
    """One optimizer step on the mean loss over ``micro_batches`` (this DP rank's share).

    Returns the per-micro-batch metrics of the loss function (last pipeline stage; empty elsewhere),
    the grad norm, whether the update was applied (False when a loss-scaled step overflowed) and
    ``non_finite``: None, or "loss" / "gradient" when some rank saw a NaN or infinity there; then
    the optimizer was not stepped (decided by every rank together, so they all skip it alike).
    """
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = forward_backward(ddp_model, micro_batches, loss_fn, forward_only=False)
    non_finite = _non_finite(ddp_model, metrics)
    if non_finite is not None:
        return {"metrics": metrics, "grad_norm": float("nan"), "update_successful": False, "non_finite": non_finite}
    update_successful, grad_norm, _ = optimizer.step()
    if grad_norm is None:  # megatron measures the norm only when it clips (clip_grad > 0)
        grad_norm = compat.unclipped_grad_norm(optimizer)
    return {"metrics": metrics, "grad_norm": grad_norm, "update_successful": update_successful, "non_finite": None,
            "moe": {**moe_losses(ddp_model, len(micro_batches)), **_replay_stats(ddp_model)}}


def _replay_stats(model: torch.nn.Module) -> Dict[str, float]:
    """With routing replay: ``moe/replay_moved``, the share of the step's replayed token routings
    that the router, left alone, would have sent to other experts (the same on every rank)."""
    if not routing.enabled(model):
        return {}
    groups = groups_of(model)
    share = routing.moved_share(model, (groups.pp, groups.dp))
    return {} if share is None else {"moe/replay_moved": share}


def moe_losses(model: torch.nn.Module, micro_batches: int) -> Dict[str, float]:
    """megatron's router losses of ``model``'s last backward, without their coefficients
    (``moe/load_balancing_loss``, ``moe/z_loss``, those switched on): the mean over the layers with
    experts, the micro-batches and the DP ranks, the same on every rank. Empty for a dense model.
    Clears megatron's tracker, which every routed training forward adds to."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    config, groups = unwrap(model).config, groups_of(model)
    if not config.num_moe_experts:
        return {}
    out = {}
    layers = sum(config.moe_layer_freq)
    tracker = get_moe_layer_wise_logging_tracker()
    # The names from the config, not the tracker: a stage without experts tracks nothing but must
    # take part in the same reductions.
    names = [name for name, coeff in (("load_balancing_loss", config.moe_aux_loss_coeff),
                                      ("z_loss", config.moe_z_loss_coeff)) if coeff]
    for name in names:
        entry = tracker.get(name)
        # this stage's layers, summed over micro-batches
        total = entry["values"].sum().reshape(1) if entry else torch.zeros(1, device=get_platform().device)
        dist.all_reduce(total, group=groups.pp)
        dist.all_reduce(total, group=groups.dp)
        out[f"moe/{name}"] = total.item() / (layers * micro_batches * groups.dp.size())
    clear_aux_losses_tracker()
    return out


def _non_finite(ddp_model: torch.nn.Module, metrics: List[Dict[str, Any]]) -> Optional[str]:
    """Whether any rank holds a non-finite loss or gradient after the backward: "loss",
    "gradient" or None, the same on every rank (one all-reduce over the world)."""
    import torch.distributed as dist

    buffers = compat.ddp_buffers(ddp_model)
    loss_bad = any(not torch.isfinite(torch.as_tensor(m["loss"])).all() for m in metrics if "loss" in m)
    # One pass without a mask the size of the buffer: a NaN or infinity makes the sum one; a finite
    # buffer's sum overflows only past 3e38, where the step's norm is infinite already.
    grad_bad = any(not torch.isfinite(b.grad_data.sum()) for b in buffers)
    flags = torch.tensor([float(loss_bad), float(grad_bad)], device=buffers[0].grad_data.device if buffers else "cpu")
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return "loss" if flags[0] else "gradient" if flags[1] else None


def next_token_loss(output: torch.Tensor, mb: MicroBatch) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, Any]]:
    """Next-token cross-entropy of vocab-parallel logits ``output`` [b, s, vocab/TP] against
    ``mb["tokens"]`` [b, s] shifted by one (the last position has no target), as (sum, count,
    {"loss": mean}) for the per-token loss path (models/pipeline.py)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    per_token = at_actions(vocab_parallel_cross_entropy(output.float(), next_tokens(mb)), mb)
    return _sum_count_mean(per_token)


def scalar_regression_loss(output: torch.Tensor, mb: MicroBatch) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, Any]]:
    """Mean squared distance of a scalar head's every output [b, s, 1] from 1.0: a loss any value
    head can drive down (the smoke check and the EMS benchmark train scalar-head roles on it)."""
    return _sum_count_mean((output.float().squeeze(-1) - 1.0) ** 2)


def _sum_count_mean(per_token: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, Any]]:
    total = per_token.sum()
    return total, torch.tensor(per_token.numel(), dtype=torch.int), {"loss": total.detach() / per_token.numel()}
