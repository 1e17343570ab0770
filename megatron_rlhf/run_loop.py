"""The one run loop, every stage's (RL, SFT, reward models, DPO), read top to bottom:

    start-up     process groups; free_memory: auto chosen and the overlap budget measured (both
                 from the device memory free on every rank)
    build        the stage's steps (steps_class: the one dispatch of ``stage``) and their roles
    resume       the trained roles, the steps' own state and the random state from the checkpoint
    steps        validation before training; each step, validated at trainer.val_interval, logged,
                 saved at trainer.save_interval and at the end (trainer.async_save: in the background)
    end          the summary; a collective that failed named by the step and phase of each rank

What a stage's step does and which roles it trains is the stage's (stages/steps.py); everything
here is written once for all of them.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

from megatron_rlhf.checkpoint.run_state import cut_back, drop_set_aside
from megatron_rlhf.config import ConfigError
from megatron_rlhf.config.names import STAGES
from megatron_rlhf.startup import Prepared, check_host_memory


def steps_class(stage: str) -> type:
    """The Steps of config key ``stage``: the one dispatch of it."""
    from megatron_rlhf.config.names import registry
    from megatron_rlhf.controller import PPOController
    from megatron_rlhf.stages.dpo import DPOStage
    from megatron_rlhf.stages.prm import ProcessRewardStage
    from megatron_rlhf.stages.rm import RewardModelStage
    from megatron_rlhf.stages.sft import SFTStage

    return registry(STAGES, "stage", {"rl": PPOController, "sft": SFTStage, "rm": RewardModelStage,
                                      "prm": ProcessRewardStage, "dpo": DPOStage})[stage]


def run(prepared: Prepared) -> List[Dict[str, float]]:
    """Run ``prepared`` (startup.prepare) to its end on this rank; the metrics of each step."""
    import torch.distributed as dist

    from megatron_rlhf.memory import MemoryLedger
    from megatron_rlhf.runtime import destroy_distributed, init_distributed

    config, output_dir = prepared.config, prepared.output_dir
    init_distributed(config.parallel, seed=config.seed, timeout_s=config.trainer.collective_timeout_s)
    rank0 = dist.get_rank() == 0
    overlap_budget = _device_memory_choices(config, output_dir)
    ledger_path = os.path.join(output_dir, "memory.jsonl")
    if rank0 and os.path.exists(ledger_path) and prepared.resume_from is None:
        os.remove(ledger_path)  # a fresh run's ledger, not appended to an old one
    progress_dir = os.path.join(output_dir, ".progress")
    os.makedirs(progress_dir, exist_ok=True)
    started = time.perf_counter()
    ledger = MemoryLedger(ledger_path if rank0 else None, guard=config.trainer.memory_guard)
    steps = steps_class(config.stage).for_run(prepared, ledger, progress_dir, overlap_budget)
    history: List[Dict[str, float]] = []
    validations: List[Dict[str, float]] = []
    try:
        if prepared.resume_from is not None:
            resume(steps, prepared.resume_from)
            if rank0:
                cut_back(ledger_path, steps.iteration)
                print(f"resumed from {prepared.resume_from} ({steps.noun} {steps.iteration}, run "
                      f"{prepared.run['id']})", flush=True)
        _named_by_phase(lambda: _steps(steps, prepared, history, validations), steps, config, progress_dir)
    finally:
        steps.close()
    if rank0 and history:
        for line in steps.summary(history, time.perf_counter() - started, validations):
            print(line, flush=True)
        print(f"memory (rank 0): at most {ledger.peak_resident_bytes() / 2**20:.2f} MiB of role state resident at "
              f"once; {sum(ledger.role_peak_bytes().values()) / 2**20:.2f} MiB if every role stayed resident; "
              f"ledger in {ledger_path}", flush=True)
    destroy_distributed()
    return history


def _device_memory_choices(config, output_dir: str) -> Optional[int]:
    """free_memory: auto resolved for the device memory free on every rank (and the host arenas of
    the switches chosen checked), then generation.batch_size: auto for what the switches leave;
    the overlap budget (trainer.overlap_onload), else None."""
    import torch.distributed as dist

    from megatron_rlhf.errors import RunError
    from megatron_rlhf.memory.auto import auto_roles, device_budget, resolve_decode_slots, resolve_free_memory

    slots_auto = config.stage == "rl" and config.generation.batch_size == "auto"
    budget = device_budget() if auto_roles(config) or config.trainer.overlap_onload or slots_auto else None
    if resolve_free_memory(config, dist.get_world_size(), output_dir, budget):
        try:
            check_host_memory(config, dist.get_world_size())
        except ConfigError as e:
            raise RunError(str(e)) from None
    if slots_auto:
        resolve_decode_slots(config, dist.get_world_size(), output_dir, budget)
    return budget if config.trainer.overlap_onload else None


def _steps(steps, prepared: Prepared, history: list, validations: list) -> None:
    """Validation before training, then each step after the checkpoint's: validated at the
    interval (and after the last where the stage's checkpoint records it), logged on rank 0, saved
    at trainer.save_interval and at the end."""
    import torch.distributed as dist

    from megatron_rlhf.checkpoint.background import CheckpointSaves
    from megatron_rlhf.run_log import RunLog

    trainer = prepared.config.trainer
    log = RunLog(prepared.output_dir, prepared.config, dist.get_rank() == 0, steps.total, steps.label,
                 resumed_at=steps.iteration)
    saves = CheckpointSaves(trainer.async_save)
    try:
        if trainer.val_before_train and steps.iteration == 0 and steps.validates:
            validations.append(steps.validate())
            if log.enabled:
                log.record({"iteration": 0, **validations[-1]})
                log.write(" | ".join(["validation before training"] + steps.validation_line(validations[-1])), 0)
        for iteration in range(steps.iteration + 1, steps.total + 1):
            steps.role_set.progress.iteration = steps.role_set.ledger.iteration = iteration
            started = time.perf_counter()
            metrics = {"iteration": iteration, **steps.step(iteration)}
            metrics["time/iteration_s"] = time.perf_counter() - started
            last = iteration == steps.total
            if steps.validates and (trainer.val_interval and iteration % trainer.val_interval == 0
                                    or last and steps.validates_after_last):
                validations.append(steps.validate())
                metrics.update(validations[-1])
            history.append(metrics)
            log.step(metrics, " | ".join([f"{steps.unit} {iteration:>4}/{steps.total}"] + steps.line(metrics)),
                     steps.samples)
            if log.enabled:  # the new run has a step: the run --overwrite set aside goes
                drop_set_aside(prepared.output_dir)
            saves.poll()  # a save in flight finished once every rank wrote its files
            if (trainer.save_interval and iteration % trainer.save_interval == 0) or (last and trainer.save_at_end):
                saves.save(steps.role_set.roles, checkpoint_state(steps, prepared.run), prepared.output_dir,
                           model_records(steps, prepared.tokenizer))
        saves.drain()
    finally:
        log.close()


def model_records(steps, tokenizer) -> Dict[str, dict]:
    """What each trained role's model files record beside its weights: the tokenizer it read (a
    run that loads it is refused another) and its score statistics (a reward model's)."""
    scores = steps.recorded_scores()
    return {role: {"tokenizer": tokenizer.record(), "scores": scores.get(role)}
            for role in steps.config.trainable_roles}


def checkpoint_state(steps, run: dict) -> dict:
    """What a checkpoint holds beside the trained roles: the stage, the steps done, the steps' own
    state, the random state and the run's identity (checkpoint/run_checkpoint.py writes it)."""
    from megatron_rlhf.runtime.distributed import random_state

    return {"stage": steps.config.stage, "iteration": steps.iteration, "steps": steps.state_dict(),
            "rng": random_state(), "run": run}


def resume(steps, path: str) -> dict:
    """``steps`` as checkpoint ``path`` left them: the trained roles, the steps' own state, then
    the random state (collective); the checkpoint's state."""
    from megatron_rlhf.checkpoint.run_checkpoint import load_checkpoint
    from megatron_rlhf.runtime.distributed import restore_random_state

    state = load_checkpoint(steps.role_set.roles, path)
    steps.role_set.ledger.iteration = state["iteration"]
    steps.load_state_dict(state["steps"], state["iteration"])
    restore_random_state(state["rng"])
    return state


def _named_by_phase(run_steps, steps, config, progress_dir: str) -> None:
    """``run_steps()``, a collective that failed (timed out, or a peer gone) turned into a RunError
    naming the step, the phase and what each rank last recorded."""
    from megatron_rlhf.errors import RunError

    try:
        run_steps()
    except RuntimeError as e:
        what = _peer_problem(e, config.trainer.collective_timeout_s)
        if what is None:
            raise
        first = str(e).strip().splitlines()[0][:200]
        phase, iteration = steps.role_set.progress.phase, steps.role_set.progress.iteration
        when = f"{steps.noun} {iteration}" if iteration else f"before the first {steps.noun}"
        elsewhere = _ranks_elsewhere(progress_dir, iteration, phase, steps.noun)
        raise RunError(f"{when}, {phase}: {what}; {elsewhere} [{first}]") from None


def _ranks_elsewhere(progress_dir: str, iteration: int, phase: str, noun: str) -> str:
    """The ranks whose last recorded (step, phase) is not this rank's (who did not arrive), and
    those of this host whose process is gone (killed or crashed without a word)."""
    import socket

    import psutil
    import torch.distributed as dist

    behind, gone = [], []
    for rank in range(dist.get_world_size()):
        try:
            with open(os.path.join(progress_dir, f"rank{rank}"), encoding="utf-8") as f:
                their_iteration, their_phase, since, host, pid = f.read().split("\t")
        except (OSError, ValueError):
            behind.append(f"rank {rank} (no record)")
            continue
        if host == socket.gethostname() and not psutil.pid_exists(int(pid)):
            gone.append(f"rank {rank} (pid {pid}) ended in {noun} {their_iteration}, {their_phase}, without a "
                        "word: killed (the kernel's out-of-memory killer says so in dmesg) or crashed")
        elif (int(their_iteration), their_phase) != (iteration, phase):
            behind.append(f"rank {rank} in {noun} {their_iteration}, {their_phase} for "
                          f"{time.time() - float(since):.0f}s")
    if gone or behind:
        return "; ".join(gone + (["elsewhere: " + "; ".join(behind)] if behind else []))
    return "every rank recorded this phase (one that stopped says why in its output, or torchrun names its exit code)"


def _peer_problem(error: RuntimeError, timeout_s: float) -> Optional[str]:
    """What a collective's failure says of the other ranks (gloo and NCCL in their own words), or
    None for an error of this rank's own (every RunError: its words may say "timed out" of a reward)."""
    from megatron_rlhf.errors import RunError

    if isinstance(error, RunError):
        return None
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        return f"a collective waited longer than trainer.collective_timeout_s={timeout_s:g}s: another rank did not arrive"
    if "connection closed by peer" in text or "connection reset by peer" in text or "broken pipe" in text:
        return "another rank stopped in the middle of a collective"
    return None
