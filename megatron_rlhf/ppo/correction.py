"""Rollout correction: the tokens of a rollout were sampled by a behaviour policy (older weights
with partial rollouts, the engine's own numerics on GPU) that is not quite the policy whose "old"
log-probs start the update's ratio. Importance weights pi_old / pi_behaviour correct for it:
truncated (TIS: each weight capped at a threshold, as slime's and verl's) or as a mask (tokens, or
whole sequences, whose ratio leaves a band are left out of the policy loss). Pure tensor functions.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

from megatron_rlhf.config.names import ROLLOUT_CORRECTIONS, registry
from megatron_rlhf.ppo.core import bounded_log_ratio, kl_k3


@dataclasses.dataclass
class Correction:
    """weights [B, T]: the factor of each token's policy loss (detached; 1 where nothing is
    weighed); keep [B, T]: the tokens the policy loss counts (the action mask, less those masked)."""

    weights: torch.Tensor
    keep: torch.Tensor


def log_ratios(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor,
               level: str) -> torch.Tensor:
    """[B, T] log(pi_old / pi_behaviour) of each action: its own (``token``), or its sequence's
    (``sequence``: the sum over the row's masked tokens, the log of the product of their ratios,
    at every token of the row); 0 outside ``mask``."""
    per_token = (old_log_probs - behaviour_log_probs) * mask
    if level == "token":
        return per_token
    if level == "sequence":
        return per_token.sum(dim=-1, keepdim=True).expand_as(per_token) * mask
    raise ValueError(f"rollout correction level must be token or sequence, got {level!r}")


def _off(ratio_log: torch.Tensor, mask: torch.Tensor, band: Tuple[float, float]) -> Correction:
    return Correction(torch.ones_like(ratio_log), mask)


def _truncate(ratio_log: torch.Tensor, mask: torch.Tensor, band: Tuple[float, float]) -> Correction:
    """Truncated importance sampling: weight min(ratio, band's high) on every token."""
    return Correction(torch.exp(bounded_log_ratio(ratio_log)).clamp(max=band[1]) * mask + (1 - mask), mask)


def _mask(ratio_log: torch.Tensor, mask: torch.Tensor, band: Tuple[float, float]) -> Correction:
    """Rejection: tokens whose ratio lies outside [low, high] leave the loss; the rest weigh 1."""
    ratio = torch.exp(bounded_log_ratio(ratio_log))
    inside = (ratio >= band[0]) & (ratio <= band[1])
    return Correction(torch.ones_like(ratio_log), mask * inside.to(mask.dtype))


CORRECTIONS = registry(ROLLOUT_CORRECTIONS, "algorithm.rollout_correction.mode",
                       {"off": _off, "truncate": _truncate, "mask": _mask})


def rollout_correction(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor,
                       mode: str, level: str, band: Tuple[float, float]) -> Correction:
    """The correction of ``mode`` (CORRECTIONS) for a rollout: old_log_probs, behaviour_log_probs,
    mask [B, T]; ``band`` (low, high): truncate caps the weight at high, mask keeps ratios within.
    With behaviour == old every ratio is exactly 1: the weights are 1 and nothing is masked."""
    mask = mask.to(old_log_probs.dtype)
    return CORRECTIONS[mode](log_ratios(old_log_probs, behaviour_log_probs, mask, level), mask, band)


def mismatch_figures(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor,
                     correction: Correction) -> dict:
    """figure -> (numerator, denominator), sums over this share of the rollout (the figure is the
    ratio of the sums over every DP rank): behaviour_kl: KL(pi_behaviour || pi_old) per token (k3:
    the tokens were drawn from the behaviour policy); is_weight_mean: the weight of the tokens the
    loss counts; masked_share: the tokens left out."""
    mask = mask.to(old_log_probs.dtype)
    tokens, kept = mask.sum(), correction.keep.sum()
    kl = kl_k3(behaviour_log_probs - old_log_probs) * mask
    return {"rollout/behaviour_kl": (kl.sum(), tokens),
            "rollout/is_weight_mean": ((correction.weights * correction.keep).sum(), kept),
            "rollout/masked_share": (tokens - kept, tokens)}
