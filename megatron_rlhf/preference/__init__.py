"""The math of the stages before RL, as pure tensor functions: the Bradley-Terry loss of a reward
model, the DPO losses (DPO_LOSSES, by name, checked against the config's names) and the masked
negative log-likelihood of SFT and of DPO's NLL term."""

from megatron_rlhf.preference.core import (
    DPO_LOSSES,
    DPOLoss,
    bradley_terry_loss,
    dpo_log_ratio_margin,
    ipo_loss,
    masked_nll_sum,
    sequence_log_probs,
    sigmoid_dpo_loss,
)

__all__ = [
    "DPO_LOSSES",
    "DPOLoss",
    "bradley_terry_loss",
    "dpo_log_ratio_margin",
    "ipo_loss",
    "masked_nll_sum",
    "sequence_log_probs",
    "sigmoid_dpo_loss",
]
