"""Preference and supervised losses as pure functions of per-sequence figures (shapes in each
docstring; P pairs, B sequences, T action positions). Each returns a per-pair (or summed) loss;
the stages' megatron loss functions (stages/losses.py) sum them over a micro-batch and let
megatron divide by the step's count, so a step's loss is the mean over its pairs whatever the cut."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from megatron_rlhf.config.names import DPO_LOSSES as DPO_LOSS_NAMES, registry


def sequence_log_probs(token_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The log-probability of each sequence's trained tokens: [B, T] x [B, T] -> [B] (fp32 sums)."""
    return (token_log_probs.float() * mask).sum(dim=1)


def masked_nll_sum(token_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood summed over the masked tokens: [B, T] x [B, T] -> [] (SFT's loss
    sum; its mean is this over mask.sum())."""
    return -(token_log_probs.float() * mask).sum()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: Optional[torch.Tensor] = None,
                       center_coefficient: Optional[float] = None) -> torch.Tensor:
    """-log sigmoid(r_c - r_r - margin) per pair, plus center_coefficient * (r_c + r_r)^2 (TRL's
    centring term: its mean over pairs is TRL's). [P] scores (and margins) -> [P]."""
    difference = chosen - rejected - (margin if margin is not None else 0.0)
    loss = -F.logsigmoid(difference)
    if center_coefficient is not None:
        loss = loss + center_coefficient * (chosen + rejected) ** 2
    return loss


def dpo_log_ratio_margin(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                         ref_rejected: torch.Tensor, chosen_tokens: Optional[torch.Tensor] = None,
                         rejected_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)), each side's log-ratio over its own
    response tokens when the token counts are given (length normalisation). [P] each -> [P]."""
    chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if chosen_tokens is not None:
        chosen, rejected = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
    return chosen - rejected


def sigmoid_dpo_loss(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al.), conservative with label smoothing e (Mitchell): -(1-e) log sigmoid(beta h)
    - e log sigmoid(-beta h). [P] -> [P]."""
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def ipo_loss(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """IPO (Azar et al., eq. 17): (h - 1 / (2 beta))^2, h from length-normalised log-ratios. [P] -> [P]."""
    return (h - 1 / (2 * beta)) ** 2


@dataclasses.dataclass(frozen=True)
class DPOLoss:
    """A DPO loss: ``per_pair(h, beta, label_smoothing)`` and whether it reads length-normalised
    log-ratios whatever dpo.length_normalize says (``normalized(length_normalize)``)."""

    per_pair: Callable[[torch.Tensor, float, float], torch.Tensor]
    normalized: Callable[[bool], bool]


# The one dispatch of dpo.loss_type.
DPO_LOSSES: Dict[str, DPOLoss] = registry(DPO_LOSS_NAMES, "dpo.loss_type", {
    "sigmoid": DPOLoss(sigmoid_dpo_loss, lambda length_normalize: length_normalize),
    "ipo": DPOLoss(ipo_loss, lambda length_normalize: True),  # TRL's and the IPO authors' normalisation
})
