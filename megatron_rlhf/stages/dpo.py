"""Direct preference optimisation (``stage: dpo``): the policy against a frozen reference (the
policy's starting weights unless reference.load says otherwise) on preference pairs; the losses of
the dpo section (preference/core.py DPO_LOSSES), metrics under TRL's names.

    reference  the reference's log-probs of both sides of the pairs, summed over each response:
               per_step: of each step's pairs, the reference on the device for that pass alone (EMS
               offloads it before the policy comes); precompute: of every pair once, before the first
               step (split over the DP ranks and gathered), the reference never on the device again
    step       the policy on the device; this rank's share of the step's pairs, whole pairs per
               micro-batch with their reference log-probs; one optimizer step on the mean loss
    validate   the same figures on data.val_file's pairs, nothing trained

Its checkpoint's ``policy/`` directory loads as PPO's policy and reference as it is.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_rlhf import preference
from megatron_rlhf.roles.inference import log_probs
from megatron_rlhf.stages.batches import padded, pair_micro_batches
from megatron_rlhf.stages.losses import dpo_loss_fn
from megatron_rlhf.stages.stage import Stage, dp_share


class DPOStage(Stage):
    trained = "policy"

    def __init__(self, config, roles, tokenizer, pairs, val_pairs):
        super().__init__(config, roles, tokenizer, pairs, val_pairs)
        self.vocab_size = tokenizer.vocab_size
        self.precomputed: Dict[int, torch.Tensor] = {}  # id(pairs) -> [N, 2] (reference_logps: precompute)

    def micro_batches(self, pairs, indices: List[int], **columns) -> list:
        columns = {"ref_logps": self.reference_logps(pairs, indices), **columns}
        return pair_micro_batches(self.role.config, [pairs.pairs[i] for i in indices], self.pipelined, self.pad_id,
                                  self.device, columns)

    def train_on(self, rows: List[int], iteration: int) -> Dict[str, float]:
        chosen_tokens = sum(self.data.pairs[i].chosen.response_tokens for i in rows)
        self.loss_fn = dpo_loss_fn(self.vocab_size, self.config.dpo, len(rows) / max(chosen_tokens, 1))
        return super().train_on(rows, iteration)

    def validate(self) -> Dict[str, float]:
        rows = self.validation_rows()
        everyone = len(rows) * self.roles.cut.size  # the first rows of the file, every rank's share
        chosen_tokens = sum(p.chosen.response_tokens for p in self.val_data.pairs[:everyone])
        self.loss_fn = dpo_loss_fn(self.vocab_size, self.config.dpo, everyone / max(chosen_tokens, 1))
        return self.evaluate(self.micro_batches(self.val_data, rows))

    def reference_logps(self, pairs, indices: List[int]) -> torch.Tensor:
        """[len(indices), 2]: the reference's log-probs of each pair's chosen and rejected response."""
        if self.config.dpo.reference_logps == "precompute":
            if id(pairs) not in self.precomputed:
                self.precomputed[id(pairs)] = self._every_pair(pairs)
            return self.precomputed[id(pairs)][indices]
        return self._score(pairs, indices)

    def _score(self, pairs, indices: List[int]) -> torch.Tensor:
        sides = [pairs.pairs[i].chosen for i in indices] + [pairs.pairs[i].rejected for i in indices]
        tokens, mask, lengths = padded(sides, self.pad_id, self.device)
        with self.roles.resident("reference", "inference"):
            per_token = log_probs(self.roles["reference"], tokens, lengths, self.vocab_size)
        per_sequence = preference.sequence_log_probs(per_token, mask)
        return torch.stack([per_sequence[: len(indices)], per_sequence[len(indices) :]], dim=1)

    def _every_pair(self, pairs) -> torch.Tensor:
        """Every pair's reference log-probs, each DP rank scoring an equal share (the last padded
        with pair 0), gathered in order: the same [N, 2] on every rank."""
        cut, count = self.roles.cut, len(pairs)
        per_rank = -(-count // cut.size)
        indices = list(range(count)) + [0] * (per_rank * cut.size - count)
        mine = self._score(pairs, dp_share(indices, cut))
        return cut.gather_tensor(mine)[:count].cpu()

    def headline(self, metrics: Dict[str, float]) -> List[str]:
        return [f"loss {metrics['loss']:.4f}", f"accuracy {metrics.get('rewards/accuracies', float('nan')):.3f}",
                f"margin {metrics.get('rewards/margins', float('nan')):+.3f}"]
