"""A stage before RL as the run loop (run_loop.py) runs it: one trained role, its loss and its
micro-batches (the stage's own: stages/sft.py, rm.py, dpo.py), optimizer steps over the epochs of
its rows (data/epochs.py), validation with the same loss."""

from __future__ import annotations

from typing import Dict, List

from megatron_rlhf.models.decoder import groups_of
from megatron_rlhf.roles.update import step_applied
from megatron_rlhf.stages.losses import step_metrics
from megatron_rlhf.stages.steps import Steps


class Stage(Steps):
    """A stage's steps: one trained role (``trained``) and its loss (``loss_fn``), on micro-batches
    of its rows (``micro_batches``: the stage's own cut). ``train_on(rows, iteration)`` trains on
    this rank's share of a step's rows (``rows``: every DP rank's, in the step's order);
    ``validate()`` scores the validation rows with the same loss, nothing trained; ``headline``: a
    step's own printed figures."""

    trained: str
    validates_after_last = True  # the figures the checkpoint keeps (a reward model's scores)

    def __init__(self, config, roles, tokenizer, data, val_data):
        from megatron_rlhf.data.epochs import EpochOrder
        from megatron_rlhf.runtime.platform import get_platform

        self.config, self.roles, self.role_set, self.pad_id = config, roles, roles, tokenizer.pad_id
        self.data, self.val_data = data, val_data
        self.order = EpochOrder.of(config, len(data))
        self.total, self.validates, self.label = self.order.total_steps, val_data is not None, config.stage.upper()
        self.device = get_platform().device
        self.skipped: List[int] = []

    @classmethod
    def for_run(cls, prepared, ledger, progress_dir: str, overlap_budget) -> "Stage":
        from megatron_rlhf.roles.role_set import Progress, RoleSet

        roles = RoleSet(prepared.config, ledger, prepared.tokenizer.pad_id, overlap_budget, Progress(progress_dir))
        return cls(prepared.config, roles, prepared.tokenizer, prepared.dataset, prepared.val_dataset)

    @property
    def role(self):
        return self.roles[self.trained]

    @property
    def pipelined(self) -> bool:
        return groups_of(self.role.model).pp.size() > 1

    def micro_batches(self, data, indices: List[int], **columns) -> list:
        raise NotImplementedError

    def headline(self, metrics: Dict[str, float]) -> List[str]:
        raise NotImplementedError

    def step(self, iteration: int) -> Dict[str, float]:
        self.iteration = iteration
        return {"epoch": float(self.order.epoch_of(iteration - 1) + 1),
                **self.train_on(self.order.step_rows(iteration - 1), iteration)}

    def train_on(self, rows: List[int], iteration: int) -> Dict[str, float]:
        return self.train(self.micro_batches(self.data, dp_share(rows, self.roles.cut)), iteration)

    def validate(self) -> Dict[str, float]:
        return self.evaluate(self.micro_batches(self.val_data, self.validation_rows()))

    def train(self, micro_batches: list, iteration: int) -> Dict[str, float]:
        """One optimizer step of the trained role (on the device for it) on ``micro_batches``; its figures."""
        with self.roles.resident(self.trained, "training"):
            result = self.role.train_step(micro_batches, self.loss_fn)
        if step_applied(result, self.config, self.trained, f"step {iteration}"):
            figures = {**self.figures(result["metrics"]), f"{self.trained}/grad_norm": float(result["grad_norm"])}
        else:
            self.skipped.append(iteration)
            figures = {"loss": float("nan")}
        return {**figures, f"{self.trained}/skipped_steps": float(len(self.skipped))}

    def evaluate(self, micro_batches: list) -> Dict[str, float]:
        with self.roles.resident(self.trained, "inference"):
            return self.figures(self.role.evaluate(micro_batches, self.loss_fn), "val/")

    def figures(self, per_micro_batch: list, prefix: str = "") -> Dict[str, float]:
        """The loss function's metric sums as means over the whole step (every rank's micro-batches)."""
        figures = step_metrics(per_micro_batch, self.device, groups_of(self.role.model).pp, self.roles.figures_group)
        return {f"{prefix}{k}": v for k, v in figures.items()}

    def state_dict(self) -> Dict:
        return {"skipped": list(self.skipped)}

    def load_state_dict(self, state: Dict, iteration: int) -> None:
        self.iteration, self.skipped = iteration, list(state["skipped"])

    def line(self, metrics: Dict[str, float]) -> List[str]:
        return self.headline(metrics) + self.validation_line(metrics) + [f"{metrics['time/iteration_s']:.1f}s"]

    def summary(self, history: List[Dict[str, float]], seconds: float, validations: List[Dict[str, float]]) -> List[str]:
        return [f"done: {len(history)} steps in {seconds:.0f}s; " + " | ".join(self.headline(history[-1]))]

    def validation_rows(self) -> List[int]:
        """This rank's share of the validation rows (equal micro-batches where pipelined)."""
        rc = self.role.config
        return validation_share(len(self.val_data), self.roles.cut,
                                rc.micro_batch_size if self.pipelined and rc.token_budget is None else 1)


def dp_share(rows: List[int], cut) -> List[int]:
    """This DP rank's consecutive share of a step's rows."""
    n = len(rows) // cut.size
    return rows[cut.rank * n : (cut.rank + 1) * n]


def validation_share(count: int, cut, multiple: int = 1) -> List[int]:
    """This rank's share of ``count`` validation rows: equal shares of the largest multiple of
    DP x ``multiple`` rows (a pipelined forward needs micro-batches of equal rows)."""
    per_rank = count // (cut.size * multiple) * multiple
    return list(range(cut.rank * per_rank, (cut.rank + 1) * per_rank))
