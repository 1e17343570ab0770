"""The RL math's names a config chooses from, in one place: config/schema.py types its keys by
them, and megatron_rlhf.ppo implements and dispatches on exactly these (checked when it is imported,
ppo/registry.py). Torch-free, like the rest of the config package."""

# algorithm.advantage_estimator (ppo/advantages.py ESTIMATORS)
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
CRITIC_ESTIMATORS = ("gae",)  # need the value model
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")  # baseline: the prompt's other responses
# ppo.kl_estimator (ppo/core.py kl_penalty)
KL_ESTIMATORS = ("k1", "k3", "low_var_kl")
# ppo.loss_agg_mode (ppo/core.py aggregate_loss)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# ppo.policy_loss (ppo/core.py POLICY_LOSSES)
POLICY_LOSSES = ("vanilla", "gspo")
