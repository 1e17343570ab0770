"""Supervised fine-tuning (``stage: sft``): the policy learns its demonstrations' responses (the
next-token loss on the response tokens only, a mean over every such token of the step; the sft
section; data/demonstrations.py).

    step       the policy on the device (EMS); this rank's share of the step's rows, grouped by length
               or packed by tokens (micro_batch_size: auto); one optimizer step
    validate   the same loss on data.val_file's rows, nothing trained

Its checkpoint's ``policy/`` directory loads as PPO's policy and reference (``load``) as it is.
"""

from __future__ import annotations

from typing import Dict, List

from megatron_rlhf.stages.batches import row_micro_batches
from megatron_rlhf.stages.losses import sft_loss_fn
from megatron_rlhf.stages.stage import Stage


class SFTStage(Stage):
    trained = "policy"

    def __init__(self, config, roles, tokenizer, demonstrations, val_demonstrations):
        super().__init__(config, roles, tokenizer, demonstrations, val_demonstrations)
        self.loss_fn = sft_loss_fn(tokenizer.vocab_size)

    def micro_batches(self, demonstrations, indices: List[int], **columns) -> list:
        return row_micro_batches(self.role.config, [demonstrations.rows[i] for i in indices], self.pipelined,
                                 self.pad_id, self.device)

    def headline(self, metrics: Dict[str, float]) -> List[str]:
        return [f"loss {metrics['loss']:.4f}"]
