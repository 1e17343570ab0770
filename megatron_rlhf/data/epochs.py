"""The order a stage before RL reads its rows in: each epoch a permutation of every row (from the run's
seed and the epoch; file order without shuffle), cut into optimizer steps of ``batch`` rows; the
tail of an epoch too short for a step is left out of that epoch. A step's rows follow from the step's
number alone, so a resumed run reads what an uninterrupted one would, at any DP size."""

from __future__ import annotations

from typing import List, Optional

import torch


class EpochOrder:
    def __init__(self, rows: int, batch: int, epochs: int, max_steps: Optional[int], seed: int, shuffle: bool):
        if rows < batch:
            raise ValueError(f"{rows} rows, fewer than one optimizer step of {batch}")
        self.rows, self.batch, self.seed, self.shuffle = rows, batch, seed, shuffle
        self.steps_per_epoch = rows // batch
        self.total_steps = min(epochs * self.steps_per_epoch, max_steps or epochs * self.steps_per_epoch)

    @classmethod
    def of(cls, config, rows: int) -> "EpochOrder":
        """The order of a stage before RL (an RLHFConfig) over ``rows`` rows: steps of its trained
        role's global_batch_size, its section's epochs and max_steps, the run's seed and data.shuffle."""
        section = config.stage_config
        return cls(rows, config.samples_per_step(config.trainable_roles[0]), section.epochs, section.max_steps,
                   config.seed, config.data.shuffle)

    def epoch_of(self, step: int) -> int:
        """The epoch (from 0) of step ``step`` (from 0)."""
        return step // self.steps_per_epoch

    def _permutation(self, epoch: int) -> List[int]:
        if not self.shuffle:
            return list(range(self.rows))
        return torch.randperm(self.rows, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)).tolist()

    def step_rows(self, step: int) -> List[int]:
        """The rows of optimizer step ``step`` (from 0), over every DP rank."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        return self._permutation(epoch)[offset * self.batch : (offset + 1) * self.batch]
