"""The run every stage before RL shares, read top to bottom: the process groups, the stage's roles
(built by roles.RoleSet, moved by EMS), resume, then optimizer steps over the epochs of its rows
(data/epochs.py), validation at trainer.val_interval and after the last step, a checkpoint at
trainer.save_interval and at the end (checkpoint/ppo_state.py: the trained role's directory loads as a model checkpoint as it is),
metrics.jsonl, TensorBoard and one line per step (run_log.py). What a step does is the stage's own
(stages/sft.py, rm.py, dpo.py: ``Stage``)."""

from __future__ import annotations

import os
import random
import time
from typing import Dict, List

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf.errors import NonFiniteError
from megatron_rlhf.models.decoder import groups_of
from megatron_rlhf.run_log import RunLog
from megatron_rlhf.stages.losses import step_metrics


class Stage:
    """A stage's steps: one trained role (``trained``) and its loss (``loss_fn``), on micro-batches
    of its rows (``micro_batches``: the stage's own cut). ``step(rows, iteration)`` trains on this
    rank's share of a step's rows (``rows``: every DP rank's, in the step's order); ``validate()``
    scores the validation rows with the same loss, nothing trained; ``line``: a step's printed figures."""

    trained: str

    def __init__(self, config, roles, tokenizer, data, val_data):
        from megatron_rlhf.runtime.platform import get_platform

        self.config, self.roles, self.pad_id = config, roles, tokenizer.pad_id
        self.data, self.val_data = data, val_data
        self.device = get_platform().device
        self.skipped: List[int] = []

    @property
    def role(self):
        return self.roles[self.trained]

    @property
    def pipelined(self) -> bool:
        return groups_of(self.role.model).pp.size() > 1

    def micro_batches(self, data, indices: List[int], **columns) -> list:
        raise NotImplementedError

    def line(self, metrics: Dict[str, float]) -> List[str]:
        raise NotImplementedError

    def step(self, rows: List[int], iteration: int) -> Dict[str, float]:
        return self.train(self.micro_batches(self.data, dp_share(rows, self.roles.cut)), iteration)

    def validate(self) -> Dict[str, float]:
        return self.evaluate(self.micro_batches(self.val_data, self.validation_rows()))

    def train(self, micro_batches: list, iteration: int) -> Dict[str, float]:
        """One optimizer step of the trained role (on the device for it) on ``micro_batches``; its figures."""
        with self.roles.resident(self.trained, "training"):
            result = self.role.train_step(micro_batches, self.loss_fn)
        applied = checked(result, self.config, self.trained, iteration, self.skipped)
        figures = {**self.figures(result["metrics"]), f"{self.trained}/grad_norm": float(result["grad_norm"])} \
            if applied else {"loss": float("nan")}
        return {**figures, f"{self.trained}/skipped_steps": float(len(self.skipped))}

    def evaluate(self, micro_batches: list) -> Dict[str, float]:
        with self.roles.resident(self.trained, "inference"):
            return self.figures(self.role.evaluate(micro_batches, self.loss_fn), "val/")

    def figures(self, per_micro_batch: list, prefix: str = "") -> Dict[str, float]:
        """The loss function's metric sums as means over the whole step (every rank's micro-batches)."""
        figures = step_metrics(per_micro_batch, self.device, groups_of(self.role.model).pp, self.roles.cut.group)
        return {f"{prefix}{k}": v for k, v in figures.items()}

    def recorded_scores(self) -> Dict[str, dict]:
        """role -> the score statistics its checkpoint records (a reward model's); none by default."""
        return {}

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


def checked(result: Dict, config, name: str, iteration: int, skipped: List[int]) -> bool:
    """Whether a train_step's update was applied: a non-finite loss or gradient stops the run
    (trainer.on_non_finite: stop) or is counted and skipped."""
    if result["non_finite"] is None:
        return True
    if config.trainer.on_non_finite == "stop":
        raise NonFiniteError(f"step {iteration}: {name}: non-finite {result['non_finite']}; the step was not applied "
                             f"and nothing of it was saved. Look for a learning rate too high ({name}.lr="
                             f"{config.role(name).lr}); trainer.on_non_finite: skip skips such steps", collective=True)
    skipped.append(iteration)
    return False


def run_stage(prepared, stage_class) -> list:
    """Run ``prepared`` (train.Prepared of a stage before RL) with its Stage class; the metrics of each step."""
    from megatron_rlhf.data.epochs import EpochOrder
    from megatron_rlhf.memory import MemoryLedger
    from megatron_rlhf.roles.role_set import Progress, RoleSet
    from megatron_rlhf.runtime import destroy_distributed, init_distributed

    config, output_dir = prepared.config, prepared.output_dir
    init_distributed(config.parallel, seed=config.seed, timeout_s=config.trainer.collective_timeout_s)
    rank0 = dist.get_rank() == 0
    ledger_path = os.path.join(output_dir, "memory.jsonl")
    if rank0 and os.path.exists(ledger_path) and prepared.resume_from is None:
        os.remove(ledger_path)  # a fresh run's ledger, not appended to an old one
    progress_dir = os.path.join(output_dir, ".progress")
    os.makedirs(progress_dir, exist_ok=True)
    ledger = MemoryLedger(ledger_path if rank0 else None, guard=config.trainer.memory_guard)
    roles = RoleSet(config, ledger, prepared.tokenizer.pad_id, progress=Progress(progress_dir))
    stage = stage_class(config, roles, prepared.tokenizer, prepared.dataset, prepared.val_dataset)
    order = EpochOrder.of(config, len(prepared.dataset))
    done = _resumed(prepared, roles, ledger_path) if prepared.resume_from is not None else 0  # < total: prepare()
    log = RunLog(output_dir, config, rank0, order.total_steps, config.stage.upper(), resumed_at=done)
    started = time.perf_counter()
    try:
        history = _steps(prepared, stage, roles, order, done, log)
    finally:
        log.close()
    if rank0 and history:
        print(f"done: {len(history)} steps in {time.perf_counter() - started:.0f}s; "
              + " | ".join(stage.line(history[-1])), flush=True)
    destroy_distributed()
    return history


def _resumed(prepared, roles, ledger_path: str) -> int:
    """The trained role, the RNG states and the ledger as the checkpoint left them; the steps done."""
    from megatron_rlhf.checkpoint.ppo_state import load_ppo_checkpoint
    from megatron_rlhf.checkpoint.run_state import cut_back

    state = load_ppo_checkpoint(roles.roles, prepared.resume_from)
    done = roles.ledger.iteration = state["iteration"]
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    if dist.get_rank() == 0:
        cut_back(ledger_path, done)
        print(f"resumed from {prepared.resume_from} (step {done}, run {prepared.run['id']})", flush=True)
    return done


def _steps(prepared, stage: Stage, roles, order, done: int, log: RunLog) -> list:
    """The steps after ``done``: each trained, validated at trainer.val_interval and after the
    last, logged on rank 0, and saved at trainer.save_interval and at the end."""
    from megatron_rlhf.checkpoint.background import CheckpointSaves
    from megatron_rlhf.checkpoint.run_state import drop_set_aside

    trainer, validating = prepared.config.trainer, prepared.val_dataset is not None
    if trainer.val_before_train and done == 0 and validating:
        before = {"iteration": 0, **stage.validate()}
        if log.enabled:
            log.record(before)
            log.write(" | ".join(["validation before training"] + _figures(before, "val/")), 0)
    history = []
    saves = CheckpointSaves(trainer.async_save)
    for iteration in range(done + 1, order.total_steps + 1):
        started = time.perf_counter()
        roles.progress.iteration = roles.ledger.iteration = iteration
        metrics = {"iteration": iteration, "epoch": float(order.epoch_of(iteration - 1) + 1),
                   **stage.step(order.step_rows(iteration - 1), iteration)}
        roles.ledger.record("phase_end", "iteration")
        last = iteration == order.total_steps
        if validating and (last or trainer.val_interval and iteration % trainer.val_interval == 0):
            metrics.update(stage.validate())  # and after the last step: the figures the checkpoint keeps
        metrics["time/iteration_s"] = time.perf_counter() - started
        history.append(metrics)
        if log.enabled:
            log.record(metrics)
            log.write(" | ".join([f"step {iteration:>4}/{order.total_steps}"] + stage.line(metrics)
                                 + _figures(metrics, "val/") + [f"{metrics['time/iteration_s']:.1f}s"]), 1)
            drop_set_aside(prepared.output_dir)  # the new run has a step: the run --overwrite set aside goes
        saves.poll()
        if (trainer.save_interval and iteration % trainer.save_interval == 0) or (last and trainer.save_at_end):
            rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
            saves.save(roles.roles, {"iteration": iteration, "rng": rng, "run": prepared.run}, prepared.output_dir,
                       stage.recorded_scores())
    saves.drain()
    return history


def _figures(metrics: Dict[str, float], prefix: str) -> List[str]:
    return [f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith(prefix) and isinstance(v, float)]
