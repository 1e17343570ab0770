"""The PPO losses as megatron loss functions: they read a trainable role's output for one
micro-batch and call the pure math of megatron_rlhf.ppo.

A PPO micro-batch carries ``tokens`` [b, S] and, per action position [b, S-1]: ``action_mask``,
``old_log_probs``, ``advantages`` (and ``ref_log_probs`` with the KL in the loss, ``is_weights``
with truncated rollout correction) for the policy,
or ``old_values``, ``returns`` for the value.

Each returns (loss sum, count, metrics) for megatron's per-token loss path (see models/pipeline.py):
the gradient is that of (sum over the whole global batch) / (count over the whole global batch),
whatever the micro-batch size, DP size or pipeline layout. The metrics are sums too (``loss``,
``loss_count``; ``tokens`` and per-token sums of the other statistics), so that reported figures
are aggregated the same way.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_rlhf import ppo
from megatron_rlhf.config.names import TOKEN_SUM_AGG_MODES
from megatron_rlhf.config.schema import PPOConfig
from megatron_rlhf.models import context_parallel
from megatron_rlhf.models.batches import state_values
from megatron_rlhf.models.pipeline import LossFn, broadcast_from_last_stage, sum_over
from megatron_rlhf.models.vocab_parallel import log_probs_and_entropy, reads_chunked


def policy_stats(ppo_config: PPOConfig) -> Tuple[str, ...]:
    """The per-token statistics the policy loss reports (see reported_metrics)."""
    return ("clipfrac", "approx_kl", "ratio_dev", "entropy") + (("kl",) if ppo_config.kl_in_loss else ())


def policy_loss_fn(vocab_size: int, temperature: float, ppo_config: PPOConfig, kl_coef: float = 0.0,
                   loss_norm: Optional[float] = None) -> LossFn:
    """The clipped surrogate of ``ppo_config.policy_loss`` (its clip_range, dual clip
    ``clip_ratio_c``), plus ``kl_coef`` times the per-token KL to the reference (estimator
    ``ppo_config.kl_estimator``) when ``kl_in_loss``; then the micro-batch also carries
    ``ref_log_probs``. ``loss_norm``: seq-mean-token-sum-norm's constant (the response budget)."""
    low, high = ppo_config.clip_range
    mode, kl_in_loss, estimator = ppo_config.loss_agg_mode, ppo_config.kl_in_loss, ppo_config.kl_estimator
    terms_of, dual = ppo.POLICY_LOSSES[ppo_config.policy_loss], ppo_config.clip_ratio_c

    @reads_chunked
    def loss_fn(output, mb):
        logp, entropy = log_probs_and_entropy(output, mb, vocab_size, temperature)
        mask, rows = mb["action_mask"], _row_sums(mb)
        per_token, terms = terms_of(logp, mb["old_log_probs"], mb["advantages"], low, high, mask, dual, rows)
        if "is_weights" in mb:  # rollout correction's importance weights (ppo/correction.py)
            per_token = per_token * mb["is_weights"]
        stats = {"clipfrac": terms["clipped"], "approx_kl": terms["approx_kl"], "ratio_dev": terms["ratio_dev"],
                 "entropy": entropy}
        if kl_in_loss:
            kl = ppo.kl_penalty(logp, mb["ref_log_probs"], estimator)
            per_token = per_token + kl_coef * kl
            stats["kl"] = kl.detach()
        loss_sum, count = _aggregated(per_token, mask, mode, loss_norm, mb)
        metrics = {"loss": loss_sum.detach() * _once(mode, mb), "loss_count": count, "tokens": mask.sum(),
                   **{k: ppo.masked_sum(v, mask) for k, v in stats.items()}}
        return loss_sum, count, metrics

    return loss_fn


def _row_sums(mb):
    """Each row's sums over its tokens, whole over the CP ranks (context_parallel.row_sums)."""
    return lambda partial: context_parallel.row_sums(partial, mb)


def _once(mode: str, mb) -> float:
    """A per-sequence mode's loss is every CP rank's whole: counted by one (context_parallel.counted_once)."""
    return 1.0 if mode in TOKEN_SUM_AGG_MODES else context_parallel.counted_once(mb)


def _aggregated(per_token, mask, mode: str, norm, mb):
    """ppo.aggregate_loss of a micro-batch (or of a CP rank's view of it): its sum, its count counted once."""
    loss_sum, count = ppo.aggregate_loss(per_token, mask, mode, norm, _row_sums(mb))
    return loss_sum, count if _once(mode, mb) == 1.0 else count * 0


def value_loss_fn(clip_range: Optional[float], loss_agg_mode: str, loss_norm: Optional[float] = None) -> LossFn:
    def loss_fn(output, mb):
        mask = mb["action_mask"]
        per_token, stats = ppo.value_loss_terms(state_values(output, mb), mb["old_values"], mb["returns"], clip_range)
        loss_sum, count = _aggregated(per_token, mask, loss_agg_mode, loss_norm, mb)
        metrics = {"loss": loss_sum.detach() * _once(loss_agg_mode, mb), "loss_count": count, "tokens": mask.sum(),
                   "clipfrac": ppo.masked_sum(stats["clipped"], mask)}
        return loss_sum, count, metrics

    return loss_fn


def reported_metrics(steps: List[List[Dict[str, torch.Tensor]]], prefix: str, stats: Sequence[str], device,
                     dp_group=None, pp_group=None) -> Dict[str, float]:
    """The losses' metric sums (per optimizer step, per micro-batch; last pipeline stage only)
    over every micro-batch and DP rank, aggregated as the gradient was: each step's loss is its
    loss sum / its count, averaged over the steps; the other statistics (``stats``, named the same
    on every pipeline stage) are token means over all steps. So the reported figures do not depend
    on how the work was cut either. Collective over the pipeline and DP groups (default: the run's);
    the same on every rank."""
    from megatron.core import parallel_state as ps

    keys = ("loss", "loss_count", "tokens") + tuple(stats)
    local = None
    if steps[0]:
        local = torch.tensor([[sum(float(m[k]) for m in step) for k in keys] for step in steps], dtype=torch.float64)
        local = local.to(device)
    pp_group = pp_group or ps.get_pipeline_model_parallel_group()
    sums = sum_over(broadcast_from_last_stage(local, (len(steps), len(keys)), torch.float64, device, pp_group), dp_group)
    per_step = dict(zip(keys, sums.t()))
    out = {f"loss/{prefix}": (per_step["loss"] / per_step["loss_count"].clamp(min=1)).mean().item()}
    tokens = per_step["tokens"].sum().clamp(min=1)
    out.update({f"{prefix}/{k}": (per_step[k].sum() / tokens).item() for k in stats})
    return out
