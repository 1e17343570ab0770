"""Reward-model training (``stage: rm``): the reward role (a scalar head, as PPO serves it) learns
from preference pairs with the Bradley-Terry loss (the rm section; preference/core.py).

    step       the reward role on the device (EMS); this rank's share of the step's pairs, whole
               pairs per micro-batch (stages/batches.py); one optimizer step on the mean loss over
               the step's pairs; accuracy, margin, rewards/chosen, rewards/rejected, reward/std
    validate   the same figures on data.val_file's pairs, nothing trained

Its checkpoint's ``reward/`` directory is what PPO's ``reward.load`` takes as it is (its model files
record the latest validation's score mean and std, for PPO's ``reward.normalize``), and what
tools/convert_megatron_to_hf.py exports as XForSequenceClassification (num_labels 1).
"""

from __future__ import annotations

from typing import Dict, List

from megatron_rlhf.stages.batches import pair_micro_batches
from megatron_rlhf.stages.losses import reward_loss_fn
from megatron_rlhf.stages.stage import Stage


class RewardModelStage(Stage):
    trained = "reward"

    def __init__(self, config, roles, tokenizer, pairs, val_pairs):
        super().__init__(config, roles, tokenizer, pairs, val_pairs)
        self.loss_fn = reward_loss_fn(config.rm)
        self.validated: Dict[str, float] = {}

    def validate(self) -> Dict[str, float]:
        self.validated = super().validate()
        return self.validated

    def recorded_scores(self) -> Dict[str, dict]:
        """The latest validation's score mean and std over both sides of the held-out pairs, for
        PPO's reward.normalize (OpenRLHF's normalize_reward); none without validation rows."""
        if not self.validated:
            return {}
        pairs = len(self.validation_rows()) * self.roles.cut.size
        return {self.trained: {"mean": self.validated["val/reward/mean"], "std": self.validated["val/reward/std"],
                               "pairs": pairs}}

    def micro_batches(self, pairs, indices: List[int], **columns) -> list:
        return pair_micro_batches(self.role.config, [pairs.pairs[i] for i in indices], self.pipelined, self.pad_id,
                                  self.device, columns)

    def headline(self, metrics: Dict[str, float]) -> List[str]:
        return [f"loss {metrics['loss']:.4f}", f"accuracy {metrics.get('accuracy', float('nan')):.3f}",
                f"margin {metrics.get('margin', float('nan')):+.3f}"]
