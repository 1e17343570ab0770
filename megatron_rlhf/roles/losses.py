"""The PPO losses as megatron loss functions: they read a trainable role's output for one
micro-batch and call the pure math of megatron_rlhf.ppo.

A PPO micro-batch carries ``tokens`` [b, S] and, per action position [b, S-1]: ``action_mask``,
``old_log_probs``, ``advantages`` (policy) or ``old_values``, ``returns`` (value).
"""

from __future__ import annotations

from typing import Optional

from megatron_rlhf import ppo
from megatron_rlhf.models.pipeline import LossFn
from megatron_rlhf.models.vocab_parallel import next_token_log_probs, token_entropy
from megatron_rlhf.models.batches import at_actions, state_values


def policy_loss_fn(vocab_size: int, temperature: float, clip_ratio: float) -> LossFn:
    def loss_fn(output, mb):
        logp = next_token_log_probs(output, mb["tokens"], vocab_size, temperature)
        mask = mb["action_mask"]
        loss, stats = ppo.policy_loss(logp, mb["old_log_probs"], mb["advantages"], mask, clip_ratio)
        entropy = ppo.masked_mean(at_actions(token_entropy(output.detach(), vocab_size, temperature)), mask)
        return loss, {"loss": loss.detach(), "entropy": entropy, **stats}

    return loss_fn


def value_loss_fn(clip_range: Optional[float]) -> LossFn:
    def loss_fn(output, mb):
        predicted = state_values(output)
        loss, stats = ppo.value_loss(predicted, mb["old_values"], mb["returns"], mb["action_mask"], clip_range)
        return loss, {"loss": loss.detach(), **stats}

    return loss_fn
