"""PPO math as small pure tensor functions (no Megatron, no process groups).

Shapes: ``B`` sequences, ``T`` response positions. ``mask`` [B, T] is 1.0 at response tokens that
count and 0.0 elsewhere (padding, prompt). Masked reductions average over the counted tokens of
the whole batch; a batch with no counted token gives 0, never NaN.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Optional, Tuple

import torch

from megatron_rlhf.config.names import KL_ESTIMATORS, LOSS_AGG_MODES, chosen, registry
from megatron_rlhf.config.names import STEP_AGGREGATIONS as STEP_AGGREGATION_NAMES
from megatron_rlhf.config.names import POLICY_LOSSES as POLICY_LOSS_NAMES

# --------------------------------------------------------------------------------------------------
# Masked reductions


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set. x, mask: same shape."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set (0 where there are none)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, count] of ``x`` over the masked positions, in float64: [3]. Moments of
    a batch cut into parts are the sums of the parts' (all-reduce them over data-parallel ranks)."""
    x, mask = x.double(), mask.double()
    return torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()])


def whiten_with_moments(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, shift_mean: bool = True,
                        eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std with mean and unbiased variance from ``moments`` (see masked_moments), so
    every part of a batch is whitened by the statistics of the whole. Masked-out positions are 0."""
    total, total_sq, count = moments.tolist()
    mean = total / max(count, 1.0)
    var = (total_sq - total * mean) / max(count, 1.0)
    if count > 1:
        var = var * count / (count - 1)
    whitened = (x - mean) * torch.rsqrt(torch.tensor(max(var, 0.0) + eps, dtype=x.dtype, device=x.device))
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


# --------------------------------------------------------------------------------------------------
# Loss aggregation

RowSums = Callable[[torch.Tensor], torch.Tensor]  # [B] sums of this rank's tokens -> [B] of each whole row's


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   norm: Optional[float] = None, rows: Optional[RowSums] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A per-token loss [B, T] as (sum, count) whose ratio is the loss under ``mode`` (one of
    LOSS_AGGREGATIONS); the sums and counts of any split of the rows add up to those of the whole
    batch, so the loss of a global batch does not depend on how it is cut into micro-batches or
    data-parallel ranks. Sequences without a counted token are not counted. ``count`` is an int64
    scalar. ``rows``: where a row's tokens are divided over ranks (context parallelism), each
    sequence's sums over its tokens made whole (the per-sequence modes' sum and count are then
    every such rank's, to be counted once)."""
    mask = mask.to(per_token.dtype)
    return chosen(LOSS_AGGREGATIONS, mode, "loss_agg_mode")(per_token * mask, mask, norm, rows or _own_rows)


def _own_rows(per_row: torch.Tensor) -> torch.Tensor:
    return per_row


def _token_mean(masked, mask, norm, rows):
    """Every counted token weighs the same (sum over tokens / tokens)."""
    return masked.sum(), mask.sum().to(torch.int64)


def _over_sequences(per_sequence: torch.Tensor, tokens: torch.Tensor):
    has_tokens = tokens > 0
    return (per_sequence * has_tokens).sum(), has_tokens.sum().to(torch.int64)


def _seq_mean_token_sum(masked, mask, norm, rows):
    """Each sequence's token sum, averaged over sequences."""
    return _over_sequences(rows(masked.sum(dim=-1)), rows(mask.sum(dim=-1)))


def _seq_mean_token_mean(masked, mask, norm, rows):
    """Each sequence's token mean, averaged over sequences."""
    tokens = rows(mask.sum(dim=-1))
    return _over_sequences(rows(masked.sum(dim=-1)) / tokens.clamp(min=1), tokens)


def _seq_mean_token_sum_norm(masked, mask, norm, rows):
    """Dr. GRPO: each sequence's token sum over the constant ``norm`` (the response budget, not the
    sequence's length), averaged over sequences."""
    if not norm or norm <= 0:
        raise ValueError(f"seq-mean-token-sum-norm needs a positive constant norm, got {norm!r}")
    return _over_sequences(rows(masked.sum(dim=-1)) / norm, rows(mask.sum(dim=-1)))


# masked per-token loss [B, T], mask [B, T], norm -> (sum, count)
LOSS_AGGREGATIONS = registry(LOSS_AGG_MODES, "ppo.loss_agg_mode", {
    "token-mean": _token_mean, "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean, "seq-mean-token-sum-norm": _seq_mean_token_sum_norm})


# --------------------------------------------------------------------------------------------------
# KL penalty and controllers


# A log-ratio is clamped to +-LOG_RATIO_LIMIT before exp (verl's 20): values inside are unchanged
# bit for bit; beyond it exp would overflow fp32 past 88.7 and give a NaN gradient, the clamp a zero one.
LOG_RATIO_LIMIT = 20.0


def bounded_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``log_ratio`` clamped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT] (the only input of an exp)."""
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs by ``estimator``
    (one of KL_ESTIMATES). [B, T] -> [B, T]."""
    return chosen(KL_ESTIMATES, estimator, "KL estimator")(logprobs - ref_logprobs)


def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """log p - log q (unbiased, can be negative)."""
    return log_ratio


def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """(q/p - 1) - log(q/p) (unbiased, >= 0, lower variance; Schulman's estimator); the log-ratio
    bounded before its exp (bounded_log_ratio)."""
    bounded = bounded_log_ratio(log_ratio)
    return torch.expm1(-bounded) + bounded


def kl_low_var(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 clamped to [-10, 10], so that one token the reference finds very unlikely cannot
    dominate a KL loss."""
    return kl_k3(log_ratio).clamp(-10.0, 10.0)


# log p - log q [B, T] -> the per-token KL estimate [B, T]
KL_ESTIMATES = registry(KL_ESTIMATORS, "ppo.kl_estimator", {"k1": kl_k1, "k3": kl_k3, "low_var_kl": kl_low_var})


@dataclasses.dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


@dataclasses.dataclass
class AdaptiveKLController:
    """Ziegler et al. (2019): move the coefficient so the observed KL approaches ``target``, by at
    most 20% of the error per ``horizon`` samples."""

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


# --------------------------------------------------------------------------------------------------
# Rewards


def clip_rewards(scores: torch.Tensor, clip: Optional[float]) -> torch.Tensor:
    """Scores clipped to [-clip, clip] (unchanged when clip is None)."""
    return scores if clip is None else scores.clamp(-clip, clip)


class RunningMoments:
    """Running mean and standard deviation of every score seen (parallel-merge of batch moments)."""

    def __init__(self) -> None:
        self.mean = 0.0
        self.var = 1.0  # population variance of everything seen
        self.count = 0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: torch.Tensor) -> Tuple[float, float]:
        """Fold a batch [N] in; returns that batch's mean and (unbiased) std."""
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return self.mean, self.std
        batch_mean = x.mean().item()
        batch_var = x.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total
        return batch_mean, (x.std().item() if n > 1 else 0.0)

    def state_dict(self) -> Dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], int(state["count"])


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last counted position of each row [B, T] -> [B] (-1 for an empty row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, mask: torch.Tensor,
                  step_rewards: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token rewards [B, T]: -kl_coef * kl at every counted token, plus the sequence score
    [B] at its last counted token (or, given ``step_rewards`` [B, T], those instead: a process
    reward model's step scores at their steps' ends). Rows with no counted token get nothing."""
    rewards = -kl_coef * kl * mask
    if step_rewards is not None:
        return rewards + step_rewards.to(rewards.dtype) * mask
    last = last_token_index(mask)
    rows = torch.nonzero(last >= 0).flatten()
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards


def _step_min(step_scores: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    lowest = step_scores.masked_fill(~ends, float("inf")).min(dim=1).values
    return lowest.masked_fill(~ends.any(dim=1), 0.0)  # an empty response: 0, as the other rules give it


def _step_last(step_scores: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    last = last_token_index(ends.to(step_scores.dtype))
    return step_scores.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1) * (last >= 0)


def _step_mean(step_scores: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return masked_mean(step_scores, ends.to(step_scores.dtype), dim=1)


def _step_sum(step_scores: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return masked_sum(step_scores, ends.to(step_scores.dtype), dim=1)


# A process reward model's step scores [B, T] at its steps' ends (``ends`` [B, T]) -> the response's
# score [B] (0 without a step); token: their sum (each is a reward at its step's end: token_rewards).
STEP_AGGREGATIONS = registry(STEP_AGGREGATION_NAMES, "reward.step_aggregation", {
    "min": _step_min, "last": _step_last, "mean": _step_mean, "token": _step_sum})


# --------------------------------------------------------------------------------------------------
# Losses


@dataclasses.dataclass(frozen=True)
class PolicyClip:
    """The ratio is clipped to [1 - low, 1 + high]; ``dual`` (c > 1, or None: off): where the
    advantage is negative the loss is at most -advantage * c (dual-clip PPO, Ye et al. 2020)."""

    low: float
    high: float
    dual: Optional[float] = None


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip: PolicyClip,
                       dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token max(-A * ratio, -A * clip(ratio)), dual-clipped where A < 0; and where the clip
    branch was taken (1.0, detached)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    loss = torch.maximum(unclipped, clipped)
    taken = clipped > unclipped
    if clip.dual is not None:
        capped = torch.minimum(loss, -advantages * clip.dual)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, taken.to(dtype).detach()


def policy_loss_terms(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
    mask: Optional[torch.Tensor] = None, dual_clip: Optional[float] = None, rows: Optional[RowSums] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO's per-token clipped surrogate (a loss to minimise), the ratio exp(log-ratio) clipped to
    [1 - clip_low, 1 + clip_high] (``dual_clip``: see PolicyClip): inputs [B, T] -> ([B, T],
    per-token stats: ``clipped`` (1.0 where the clipped branch was taken), ``approx_kl`` (0.5 *
    log-ratio^2) and ``ratio_dev`` (|ratio - 1|), detached). ``mask`` is not needed (per token)."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(bounded_log_ratio(log_ratio))
    loss, taken = _clipped_surrogate(ratio, advantages, PolicyClip(clip_low, clip_high, dual_clip), logprobs.dtype)
    with torch.no_grad():
        stats = {"clipped": taken, "approx_kl": 0.5 * log_ratio.detach() ** 2, "ratio_dev": (ratio.detach() - 1.0).abs()}
    return loss, stats


def gspo_loss_terms(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
    mask: Optional[torch.Tensor] = None, dual_clip: Optional[float] = None, rows: Optional[RowSums] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, the token form): every token of a sequence has the sequence's
    ratio s = exp(mean over its counted tokens of the log-ratio) as its value, and as its gradient
    s times its own log-prob's: the per-token ratio sg[s] * pi / sg[pi]. Clipped as PPO's (the
    paper's ranges are small: 3e-4 / 4e-4). Averaged per sequence (seq-mean-token-mean) it is the
    paper's sequence objective. Inputs [B, T], ``mask`` [B, T] required -> ([B, T], stats as
    policy_loss_terms, with the sequence's log-ratio for approx_kl and ratio_dev). ``rows``: as
    aggregate_loss's, for the sequence's mean."""
    if mask is None:
        raise ValueError("GSPO needs the mask: a sequence's ratio is the mean over its counted tokens")
    log_ratio = logprobs - old_logprobs
    rows = rows or _own_rows
    with torch.no_grad():  # only its value is used
        sequence = (rows(masked_sum(log_ratio, mask, dim=-1)) / rows(mask.sum(dim=-1)).clamp(min=1)).unsqueeze(-1)
    token_log_ratio = logprobs - logprobs.detach() + sequence.detach()  # value: the sequence's; gradient: the token's
    ratio = torch.exp(bounded_log_ratio(token_log_ratio))
    loss, taken = _clipped_surrogate(ratio, advantages, PolicyClip(clip_low, clip_high, dual_clip), logprobs.dtype)
    with torch.no_grad():
        seq = sequence.detach().expand_as(logprobs)
        stats = {"clipped": taken, "approx_kl": 0.5 * seq**2, "ratio_dev": (ratio.detach() - 1.0).abs()}
    return loss, stats


# The one dispatch of ppo.policy_loss: name -> per-token terms.
POLICY_LOSSES = registry(POLICY_LOSS_NAMES, "ppo.policy_loss", {"vanilla": policy_loss_terms, "gspo": gspo_loss_terms})


def value_loss_terms(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_range: Optional[float]
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Per-token clipped value loss 0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped within
    clip_range of the rollout values (no clipping when clip_range is None): [B, T] -> ([B, T],
    per-token ``clipped`` stat, detached, on the inputs' device)."""
    unclipped = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * unclipped, {"clipped": torch.zeros_like(values).detach()}
    # V clamped to the band itself (verl's clip_by_value): inside it V_clipped is V bit for bit, so a
    # token counts as clipped only where the clip acts, never by a rounding of old + (V - old).
    clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    clipped = (clipped_values - returns) ** 2
    with torch.no_grad():
        stats = {"clipped": (clipped > unclipped).to(values.dtype)}
    return 0.5 * torch.maximum(unclipped, clipped), stats


