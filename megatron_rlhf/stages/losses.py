"""The stages' losses as megatron loss functions (models/pipeline.py's LossFn: loss sum, count,
metric sums), calling the pure math of megatron_rlhf.preference. megatron divides the step's loss
sums by its counts summed over every micro-batch and DP rank, so each loss is a mean over the
step's trained tokens (SFT) or pairs (RM, DPO) whatever the micro-batch size, DP or PP.

Every metric is a sum over the micro-batch with its denominator named in ``MEANS`` (tokens, pairs
or sequences), so step_metrics reports the same figures however the step was cut.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_rlhf import preference
from megatron_rlhf.config.schema import DPOConfig, RMConfig
from megatron_rlhf.data.steps import NO_LABEL
from megatron_rlhf.models import context_parallel
from megatron_rlhf.models.pipeline import LossFn, broadcast_from_last_stage, sum_over
from megatron_rlhf.models.vocab_parallel import next_token_log_probs, reads_chunked
from megatron_rlhf.stages.batches import chosen_and_rejected
from megatron_rlhf.runtime.host_groups import host_group

# metric -> the count it is a mean over (a metric sum, summed over the step's micro-batches and ranks)
MEANS = {
    "loss": "loss_count",
    "accuracy": "pairs", "margin": "pairs", "rewards/chosen": "pairs", "rewards/rejected": "pairs",
    "rewards/accuracies": "pairs", "rewards/margins": "pairs", "logps/chosen": "pairs", "logps/rejected": "pairs",
    "reward/mean": "sequences", "reward/square_mean": "sequences", "nll": "chosen_tokens",
    "step_accuracy": "steps", "step_score/mean": "steps",
}


def sft_loss_fn(vocab_size: int) -> LossFn:
    """The next-token NLL of the response tokens (``action_mask``), a mean over the step's tokens."""

    @reads_chunked
    def loss_fn(output, mb):
        mask = mb["action_mask"]
        loss_sum = preference.masked_nll_sum(next_token_log_probs(output, mb, vocab_size), mask)
        count = mask.sum()
        return loss_sum, count, {"loss": loss_sum.detach(), "loss_count": count, "tokens": count}

    return loss_fn


def scores_at_last_token(output: torch.Tensor, mb) -> torch.Tensor:
    """A scalar head's output [b, s, 1] at each row's last token ``mb["last_index"]`` (fp32): [b]
    (under context parallelism from the CP rank that holds it: models/context_parallel.at_positions)."""
    return context_parallel.at_positions(output.float().squeeze(-1), mb["last_index"], mb)


def _pair_figures(chosen: torch.Tensor, rejected: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {"pairs": torch.tensor(float(chosen.shape[0]), device=chosen.device),
            "accuracy": (chosen > rejected).float().sum(), "margin": (chosen - rejected).sum()}


def _once(figures: Dict[str, torch.Tensor], mb) -> Dict[str, torch.Tensor]:
    """Figures of whole rows, which every CP rank computes, counted by one (context_parallel.counted_once)."""
    once = context_parallel.counted_once(mb)
    return figures if once == 1.0 else {k: v * once for k, v in figures.items()}


def reward_loss_fn(rm: RMConfig) -> LossFn:
    """Bradley-Terry on the scores of each pair's sides (their last tokens), a mean over the step's pairs."""

    def loss_fn(output, mb):
        scores = scores_at_last_token(output, mb)
        chosen, rejected = chosen_and_rejected(scores)
        loss_sum = preference.bradley_terry_loss(chosen, rejected, mb["margin"], rm.center_rewards_coefficient).sum()
        detached = scores.detach()
        pairs = torch.tensor(chosen.shape[0])
        metrics = _once({"loss": loss_sum.detach(), "loss_count": pairs,
                         **_pair_figures(chosen.detach(), rejected.detach()),
                         "rewards/chosen": chosen.detach().sum(), "rewards/rejected": rejected.detach().sum(),
                         "sequences": torch.tensor(float(scores.shape[0])), "reward/mean": detached.sum(),
                         "reward/square_mean": detached.double().pow(2).sum()}, mb)
        return loss_sum, metrics["loss_count"], metrics

    return loss_fn


def prm_loss_fn() -> LossFn:
    """The binary cross-entropy of each labelled step's score (``step_labels`` [b, s]: 1 right, 0
    wrong, NO_LABEL elsewhere) as the logit that it is right, a mean over the step's labelled steps.
    TRL's PRMTrainer's two-label cross-entropy is this loss of its logits' difference."""

    def loss_fn(output, mb):
        labels = mb["step_labels"]
        scored = labels != NO_LABEL
        scores, targets = output.float().squeeze(-1)[scored], labels[scored].float()
        loss_sum = torch.nn.functional.binary_cross_entropy_with_logits(scores, targets, reduction="sum")
        count = scored.sum()
        detached = scores.detach()
        metrics = {"loss": loss_sum.detach(), "loss_count": count, "steps": count.float(),
                   "step_accuracy": ((detached > 0).float() == targets).float().sum(), "step_score/mean": detached.sum()}
        return loss_sum, count, metrics

    return loss_fn


def dpo_loss_fn(vocab_size: int, dpo: DPOConfig, nll_scale: float = 0.0) -> LossFn:
    """The dpo.loss_type loss of each pair (the reference's log-probs in ``ref_logps`` [2k]), plus
    dpo.nll_coef times the chosen sides' NLL; a mean over the step's pairs. The NLL is TRL's, a mean
    over the step's chosen tokens: its sum here is scaled by ``nll_scale`` = the step's pairs / its
    chosen tokens, so megatron's division by the pairs leaves that mean."""
    loss = preference.DPO_LOSSES[dpo.loss_type]
    normalized = loss.normalized(dpo.length_normalize)

    @reads_chunked
    def loss_fn(output, mb):
        mask = mb["action_mask"]
        token_logps = next_token_log_probs(output, mb, vocab_size)
        # a sequence's sums over its tokens: every CP rank's part (context_parallel.row_sums)
        logps = context_parallel.row_sums(preference.sequence_log_probs(token_logps, mask), mb)
        (policy_c, policy_r), (ref_c, ref_r) = chosen_and_rejected(logps), chosen_and_rejected(mb["ref_logps"])
        tokens_c, tokens_r = chosen_and_rejected(context_parallel.row_sums(mask.sum(dim=1), mb)) if normalized \
            else (None, None)
        h = preference.dpo_log_ratio_margin(policy_c, policy_r, ref_c, ref_r, tokens_c, tokens_r)
        pair_loss = loss.per_pair(h, dpo.beta, dpo.label_smoothing).sum()
        chosen_mask = chosen_and_rejected(mask)[0]
        nll_sum = preference.masked_nll_sum(chosen_and_rejected(token_logps)[0], chosen_mask)  # this rank's tokens'
        nll = dpo.nll_coef * nll_scale * nll_sum if dpo.nll_coef else torch.zeros_like(pair_loss)
        reward_c, reward_r = dpo.beta * (policy_c - ref_c).detach(), dpo.beta * (policy_r - ref_r).detach()
        pairs = _once({"loss": pair_loss.detach(), "loss_count": torch.tensor(policy_c.shape[0]),
                       **_pair_figures(reward_c, reward_r),
                       "rewards/chosen": reward_c.sum(), "rewards/rejected": reward_r.sum(),
                       "logps/chosen": policy_c.detach().sum(), "logps/rejected": policy_r.detach().sum()}, mb)
        metrics = {**pairs, "loss": pairs["loss"] + nll.detach(), "nll": nll_sum.detach(),
                   "chosen_tokens": chosen_mask.sum()}
        metrics["rewards/accuracies"], metrics["rewards/margins"] = metrics.pop("accuracy"), metrics.pop("margin")
        return pair_loss + nll, pairs["loss_count"], metrics

    return loss_fn


def step_metrics(per_micro_batch: List[Dict[str, torch.Tensor]], device, pp_group, dp_group) -> Dict[str, float]:
    """The means of MEANS's metrics over a step's micro-batches on every DP rank (from the last
    pipeline stage; collective over PP and DP; the same on every rank), and ``reward/std`` where
    the scores' squares were summed."""
    names = sorted(per_micro_batch[0]) if per_micro_batch else None
    shared = [names]
    if pp_group.size() > 1:
        import torch.distributed as dist

        from megatron_rlhf.models.decoder import global_rank

        dist.broadcast_object_list(shared, src=global_rank(pp_group, -1), group=host_group(pp_group))
    names = shared[0]
    local = torch.tensor([sum(float(m[k]) for m in per_micro_batch) for k in names], dtype=torch.float64,
                         device=device) if per_micro_batch else None
    sums = dict(zip(names, sum_over(broadcast_from_last_stage(local, (len(names),), torch.float64, device, pp_group),
                                    dp_group).tolist()))
    out = {k: sums[k] / max(sums[MEANS[k]], 1e-30) for k in names if k in MEANS}
    if "reward/square_mean" in out:
        n = sums["sequences"]
        variance = (out.pop("reward/square_mean") - out["reward/mean"] ** 2) * n / max(n - 1, 1)
        out["reward/std"] = max(variance, 0.0) ** 0.5
    return out
