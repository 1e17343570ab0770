"""PPO math: pure tensor functions (see core.py)."""

from megatron_rlhf.ppo.core import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    clip_rewards,
    entropy_from_logits,
    gae_advantages,
    kl_penalty,
    last_token_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    token_rewards,
    value_loss,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMoments",
    "clip_rewards",
    "entropy_from_logits",
    "gae_advantages",
    "kl_penalty",
    "last_token_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "token_rewards",
    "value_loss",
]
