"""The RL run (PPO, GRPO, RLOO, REINFORCE++) after start-up: the process groups, the reward pool
and environments, the controller (resumed from its checkpoint), its iterations with validation and
checkpoints at their intervals, and a collective that fails named by what the other ranks did."""

from __future__ import annotations

import os
import time
from typing import Optional

from megatron_rlhf.checkpoint.run_state import cut_back, drop_set_aside
from megatron_rlhf.config import ConfigError
from megatron_rlhf.run_log import RLRunLog, run_summary, validation_summary
from megatron_rlhf.startup import Prepared, check_host_memory


def _run_iterations(controller, log, prepared: Prepared, validations: list, history: list) -> None:
    """Validation before training, the iterations (each validated at the interval), checkpoints."""
    from megatron_rlhf.checkpoint.background import CheckpointSaves

    config = prepared.config
    saves = CheckpointSaves(config.trainer.async_save)
    interval, val_interval = config.trainer.save_interval, config.trainer.val_interval
    if config.trainer.val_before_train and controller.iteration == 0:
        validations.append(controller.validate())
        log.log_validation(validations[-1], 0)
    while controller.iteration < config.ppo.iterations:
        metrics = controller.step()
        if val_interval and controller.iteration % val_interval == 0:
            validations.append(controller.validate())
            metrics.update(validations[-1])
        history.append(metrics)
        log.log(metrics, config.ppo.iterations, controller.last_samples)
        if log.enabled:  # the new run has an iteration: the run --overwrite set aside goes
            drop_set_aside(prepared.output_dir)
        saves.poll()  # a save in flight finished once every rank wrote its files
        last = controller.iteration == config.ppo.iterations
        if (interval and controller.iteration % interval == 0) or (last and config.trainer.save_at_end):
            saves.save(controller.roles, {**controller.state_dict(), "run": prepared.run}, prepared.output_dir)
    saves.drain()


def _ranks_elsewhere(progress_dir: str, iteration: int, phase: str) -> str:
    """The ranks whose last recorded (iteration, phase) is not this rank's (who did not arrive), and
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
            gone.append(f"rank {rank} (pid {pid}) ended in iteration {their_iteration}, {their_phase}, without a "
                        "word: killed (the kernel's out-of-memory killer says so in dmesg) or crashed")
        elif (int(their_iteration), their_phase) != (iteration, phase):
            behind.append(f"rank {rank} in iteration {their_iteration}, {their_phase} for "
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


def run_rl(prepared: Prepared) -> list:
    import torch.distributed as dist

    from megatron_rlhf.checkpoint.ppo_state import load_ppo_checkpoint
    from megatron_rlhf.controller import PPOController
    from megatron_rlhf.errors import RunError
    from megatron_rlhf.memory import MemoryLedger
    from megatron_rlhf.memory.auto import auto_roles, device_budget, resolve_free_memory
    from megatron_rlhf.rewards.pool import RewardPool
    from megatron_rlhf.rollout.scoring import scores_here
    from megatron_rlhf.runtime import destroy_distributed, init_distributed

    config, output_dir, resume_from = prepared.config, prepared.output_dir, prepared.resume_from
    init_distributed(config.parallel, seed=config.seed, timeout_s=config.trainer.collective_timeout_s)
    rank0 = dist.get_rank() == 0
    budget = device_budget() if auto_roles(config) or config.trainer.overlap_onload else None
    if resolve_free_memory(config, dist.get_world_size(), output_dir, budget):
        try:  # the arenas of the switches just chosen
            check_host_memory(config, dist.get_world_size())
        except ConfigError as e:
            raise RunError(str(e)) from None
    started = time.perf_counter()
    ledger_path = os.path.join(output_dir, "memory.jsonl")
    if rank0 and os.path.exists(ledger_path) and resume_from is None:
        os.remove(ledger_path)  # a fresh run's ledger, not appended to an old one
    scorer = None
    if prepared.reward_functions and scores_here():
        rewards = config.reward
        # The workers load the functions (checked to load at start-up) while the roles are built.
        scorer = RewardPool(prepared.reward_functions, num_workers=rewards.num_workers, timeout_s=rewards.timeout_s,
                            failure_score=rewards.failure_score, wait=False)
    progress_dir = os.path.join(output_dir, ".progress")
    os.makedirs(progress_dir, exist_ok=True)
    turns = None
    if prepared.environment is not None:
        from megatron_rlhf.rollout.multiturn import MultiTurn

        turns = MultiTurn(config, prepared.tokenizer, prepared.environment, config.data.apply_chat_template)
    controller = PPOController(config, prepared.dataset, prepared.tokenizer, scorer,
                               MemoryLedger(ledger_path if rank0 else None, guard=config.trainer.memory_guard),
                               overlap_budget=budget if config.trainer.overlap_onload else None,
                               val_dataset=prepared.val_dataset, progress_dir=progress_dir, turns=turns)
    if resume_from is not None:
        controller.load_state_dict(load_ppo_checkpoint(controller.roles, resume_from))
        if rank0:
            cut_back(ledger_path, controller.iteration)
            print(f"resumed from {resume_from} (iteration {controller.iteration}, run {prepared.run['id']})", flush=True)
    log = RLRunLog(output_dir, config, enabled=rank0, resumed_at=controller.iteration)
    history, validations = [], []
    try:
        _run_iterations(controller, log, prepared, validations, history)
    except RuntimeError as e:
        what = _peer_problem(e, config.trainer.collective_timeout_s)
        if what is None:
            raise
        first = str(e).strip().splitlines()[0][:200]
        when = f"iteration {controller.iteration}" if controller.iteration else "before the first iteration"
        elsewhere = _ranks_elsewhere(progress_dir, controller.iteration, controller.phase)
        raise RunError(f"{when}, {controller.phase}: {what}; {elsewhere} [{first}]") from None
    finally:
        log.close()
        if scorer is not None:
            scorer.close()
        if turns is not None:
            turns.close()
    if rank0 and history:
        print(run_summary(history, time.perf_counter() - started), flush=True)
        if len(validations) > 1:
            print(validation_summary(validations[0], validations[-1]), flush=True)
        sample = controller.last_samples[0]
        print(f"sample: {sample['prompt']!r} -> {sample['response']!r}", flush=True)
        ledger = controller.ledger
        print(
            f"memory (rank 0): at most {ledger.peak_resident_bytes() / 2**20:.2f} MiB of role state resident "
            f"at once; {sum(ledger.role_peak_bytes().values()) / 2**20:.2f} MiB if every role stayed resident; ledger in {ledger_path}",
            flush=True,
        )
    destroy_distributed()
    return history
