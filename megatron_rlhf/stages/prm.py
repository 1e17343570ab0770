"""Process reward models (``stage: prm``): the reward role (a scalar head, as RL serves it) learns
from stepwise rows whether each step of a solution is right: its score at the step's separator is
that logit, trained with the binary cross-entropy (the prm section; data/steps.py; TRL's PRMTrainer,
whose two-label token classifier scores the difference of its logits).

    step       the reward role on the device (EMS); this rank's share of the step's rows, grouped by
               length or packed by tokens; one optimizer step on the mean loss over the labelled
               steps (with train_on_last_step_only: each row's last); step_accuracy, step_score/mean
    validate   the same figures on data.val_file's rows, every step labelled, nothing trained

Its checkpoint's ``reward/`` directory is a reward model of the same network (reward.load).
"""

from __future__ import annotations

from typing import Dict, List

from megatron_rlhf.stages.batches import step_micro_batches
from megatron_rlhf.stages.losses import prm_loss_fn
from megatron_rlhf.stages.stage import Stage, dp_share


class ProcessRewardStage(Stage):
    trained = "reward"

    def __init__(self, config, roles, tokenizer, rows, val_rows):
        super().__init__(config, roles, tokenizer, rows, val_rows)
        self.loss_fn = prm_loss_fn()

    def train_on(self, rows: List[int], iteration: int) -> Dict[str, float]:
        return self.train(self.micro_batches(self.data, dp_share(rows, self.roles.cut), training=True), iteration)

    def micro_batches(self, rows, indices: List[int], training: bool = False, **columns) -> list:
        """``training``: with prm.train_on_last_step_only, each row's last label alone (TRL's)."""
        return step_micro_batches(self.role.config, [rows.rows[i] for i in indices], self.pipelined, self.pad_id,
                                  self.device, training and self.config.prm.train_on_last_step_only)

    def headline(self, metrics: Dict[str, float]) -> List[str]:
        return [f"loss {metrics['loss']:.4f}", f"step accuracy {metrics.get('step_accuracy', float('nan')):.3f}"]
