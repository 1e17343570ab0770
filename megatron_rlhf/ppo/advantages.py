"""Advantage estimators and the outcome-level shaping around them, as pure tensor functions.

Shapes: ``B`` responses, ``T`` response positions, ``mask`` [B, T] as in core.py. Critic-free
estimators work on a group of responses to one prompt: ``group_index`` [B] (int64) names each
response's group; any ids, in any order. A group of one has no baseline: its baseline is 0 (and
its std 1), so its advantage is its score, as verl and OpenRLHF treat it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch

from megatron_rlhf.config.names import ADVANTAGE_ESTIMATORS, registry


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation. rewards, values, mask: [B, T] -> (advantages, returns), [B, T].

    Each counted position's successor is the next counted one: in a multi-turn trajectory the
    environment's tokens (mask 0) between two turns are skipped, not an end. The last counted
    position is terminal (its next value is 0). Masked-out positions get advantage and return 0.
    """
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros_like(next_advantage)
    next_mask = torch.zeros_like(next_advantage)
    for t in reversed(range(T)):
        counted = mask[:, t].to(rewards.dtype)
        delta = rewards[:, t] + gamma * next_value * next_mask - values[:, t]
        advantage = (delta + gamma * lam * next_mask * next_advantage) * counted
        advantages[:, t] = advantage
        keep = counted > 0
        next_advantage = torch.where(keep, advantage, next_advantage)
        next_value = torch.where(keep, values[:, t], next_value)
        next_mask = torch.where(keep, counted, next_mask)
    returns = (advantages + values) * mask
    return advantages, returns


def group_moments(scores: torch.Tensor, group_index: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Each response's group statistics, in float64: scores [B], group_index [B] -> (sum, mean,
    unbiased std, size), each [B] (a group of one: std 0)."""
    ids, inverse = torch.unique(group_index, return_inverse=True)
    x = scores.double()
    size = torch.zeros(len(ids), dtype=torch.float64, device=x.device).index_add_(0, inverse, torch.ones_like(x))
    total = torch.zeros_like(size).index_add_(0, inverse, x)
    mean = total / size
    squares = torch.zeros_like(size).index_add_(0, inverse, (x - mean[inverse]) ** 2)
    std = torch.where(size > 1, squares / (size - 1).clamp(min=1), torch.zeros_like(size)).sqrt()
    return total[inverse], mean[inverse], std[inverse], size[inverse]


def grpo_advantages(scores: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor, normalize_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (score - group mean) / (group std + eps) at every response token; without
    ``normalize_by_std`` (Dr. GRPO) score - group mean. scores [B] (one outcome per response),
    group_index [B], mask [B, T] -> [B, T] (0 where mask is 0)."""
    _, mean, std, size = group_moments(scores, group_index)
    alone = size < 2
    mean = torch.where(alone, torch.zeros_like(mean), mean)
    advantage = scores.double() - mean
    if normalize_by_std:
        advantage = advantage / (torch.where(alone, torch.ones_like(std), std) + eps)
    return advantage.to(mask.dtype).unsqueeze(1) * mask


def rloo_advantages(scores: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024): score minus the mean score of the other responses in its
    group, at every response token. scores [B], group_index [B], mask [B, T] -> [B, T]."""
    total, _, _, size = group_moments(scores, group_index)
    x = scores.double()
    others = torch.where(size > 1, (total - x) / (size - 1).clamp(min=1), torch.zeros_like(x))
    return (x - others).to(mask.dtype).unsqueeze(1) * mask


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s per-token returns: sum_{k>=t} gamma^(k-t) * rewards[k] over the counted
    positions k of each response (k - t counting counted positions: a multi-turn trajectory's
    environment tokens are skipped). rewards, mask [B, T] -> [B, T] (0 where mask is 0)."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running * mask[:, t]
    return returns


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic sampling (DAPO): which groups hold responses that score differently. scores [G * n]
    in consecutive groups of ``group_size`` -> [G] bool (False: every score equal, no signal)."""
    grouped = scores.reshape(-1, group_size)
    return grouped.max(dim=1).values > grouped.min(dim=1).values


def overlong_penalty(response_lengths: torch.Tensor, max_new_tokens: int, buffer_length: int,
                     factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: [B] lengths -> [B] penalties (<= 0) to add to the scores.
    A response up to max_new_tokens - buffer_length tokens is not penalised; beyond that it loses
    factor * excess / buffer_length, reaching -factor at max_new_tokens. buffer_length 0: none."""
    lengths = response_lengths.to(torch.float32)
    if buffer_length <= 0:
        return torch.zeros_like(lengths)
    excess = (lengths - (max_new_tokens - buffer_length)).clamp(min=0)
    return -factor * excess / buffer_length


# -- the estimators by name -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EstimatorInputs:
    """What an estimator may use. rewards, mask [B, T]: per-token rewards (the outcome at the last
    response token, KL-shaped unless the KL is in the loss) and response positions; values [B, T]:
    the critic's (GAE only, else None); group_index [B]; gamma, lam: discount and GAE lambda;
    normalize_by_std: GRPO's std division (False: Dr. GRPO)."""

    rewards: torch.Tensor
    mask: torch.Tensor
    values: Optional[torch.Tensor]
    group_index: torch.Tensor
    gamma: float
    lam: float
    normalize_by_std: bool


@dataclasses.dataclass(frozen=True)
class Estimator:
    """An advantage estimator: ``advantages(inputs)`` -> (advantages [B, T], returns [B, T] or
    None); ``whitened(whiten_advantages)``: whether its advantages are then whitened over the
    whole rollout, given the config's ppo.whiten_advantages."""

    advantages: Callable[[EstimatorInputs], Tuple[torch.Tensor, Optional[torch.Tensor]]]
    whitened: Callable[[bool], bool]


def _outcomes(x: EstimatorInputs) -> torch.Tensor:
    return x.rewards.sum(dim=1)


# The one dispatch of algorithm.advantage_estimator (which need a critic or groups: config/names.py).
ESTIMATORS: Dict[str, Estimator] = registry(ADVANTAGE_ESTIMATORS, "algorithm.advantage_estimator", {
    "gae": Estimator(lambda x: gae_advantages(x.rewards, x.values, x.mask, x.gamma, x.lam), lambda whiten: whiten),
    "grpo": Estimator(lambda x: (grpo_advantages(_outcomes(x), x.group_index, x.mask, x.normalize_by_std), None),
                      lambda whiten: False),
    "rloo": Estimator(lambda x: (rloo_advantages(_outcomes(x), x.group_index, x.mask), None), lambda whiten: False),
    "reinforce_plus_plus": Estimator(lambda x: (discounted_returns(x.rewards, x.mask, x.gamma), None),
                                     lambda whiten: True),
    # The group-mean baseline (GRPO without the std), then whitened over the rollout.
    "reinforce_plus_plus_baseline": Estimator(
        lambda x: (grpo_advantages(_outcomes(x), x.group_index, x.mask, normalize_by_std=False), None),
        lambda whiten: True),
})

