"""The command line of every stage: ``torchrun --nproc_per_node=N -m megatron_rlhf.train --config
rlhf.yaml [--output-dir DIR]`` runs RL (PPO, GRPO, RLOO, REINFORCE++) or, by the config's
``stage:``, SFT, a reward model or DPO; ``--dry-run`` plans, ``--check-only`` checks every input; every stage runs the one run loop
(run_loop.py).

Writes to the output directory: ``metrics.jsonl`` (one object per iteration or step),
``memory.jsonl`` (the EMS ledger), TensorBoard events under ``tensorboard/`` and checkpoints.
A fault ends the run with one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

from megatron_rlhf.config import ConfigError
from megatron_rlhf.errors import hide_internal_warnings
from megatron_rlhf.units import parse_bytes, positive_int

# What reads a config only (--explain, --dry-run) imports no torch: startup and the run are imported
# where a launch needs them.


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron_rlhf.train", description="PPO training with megatron-core roles and EMS.")
    parser.add_argument("--config", help="the top config file (rlhf.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="set a config key over the files, checked as they are (ppo.kl_coef=0.05, policy.lr=1e-6; "
                             "a YAML value; a relative path is the working directory's)")
    parser.add_argument("--explain", metavar="KEY", help="print one config key's entry (type, default, allowed values, "
                                                          "meaning, the stages that read it) and exit")
    parser.add_argument("--output-dir", help="where metrics, the memory ledger and TensorBoard go (default: trainer.output_dir)")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete an earlier run in the output directory (metrics, ledger, TensorBoard, checkpoints)")
    parser.add_argument("--iterations", type=int, help="override ppo.iterations")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in the output directory (as trainer.resume: auto)")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume a checkpoint written with other settings (they are listed when refused)")
    dry = parser.add_argument_group("dry run (no torchrun, no GPU: print the resolved config, the layout and memory per role)")
    dry.add_argument("--dry-run", action="store_true", help="print what a launch would do and exit")
    dry.add_argument("--check-only", action="store_true",
                     help="check every input a launch reads (config, tokenizer, data, rewards, checkpoints) and exit; "
                          "nothing is written")
    dry.add_argument("--world-size", type=positive_int, help="processes of the planned launch (default: $WORLD_SIZE, else TP*PP)")
    dry.add_argument("--nproc-per-node", type=positive_int, help="processes per node (default: $LOCAL_WORLD_SIZE, else the world size)")
    dry.add_argument("--gpu-memory", type=parse_bytes, help="device memory per GPU, e.g. 80GiB: check that the plan fits")
    args = parser.parse_args(argv)
    if not args.config and not args.explain:
        parser.error("the following arguments are required: --config")
    if not args.dry_run and (args.nproc_per_node or args.gpu_memory):
        parser.error("--nproc-per-node and --gpu-memory go with --dry-run (a launch takes them from torchrun)")
    if not (args.dry_run or args.check_only) and args.world_size:
        parser.error("--world-size goes with --dry-run or --check-only (a launch takes it from torchrun)")
    return args


def _explain(key: str) -> int:
    from megatron_rlhf.config.reference import explain

    try:
        print(explain(key))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    from megatron_rlhf.dry_run import dry_run

    try:
        world_size = args.world_size or int(os.environ.get("WORLD_SIZE", 0)) or None
        nproc = args.nproc_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None
        return dry_run(args.config, world_size, nproc, args.gpu_memory, overrides=args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check_only(args: argparse.Namespace) -> int:
    """prepare() on its own (one process, nothing written): every input a launch reads, checked."""
    from megatron_rlhf.startup import INPUT_ERRORS, prepare

    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", 0)) or 1
    try:
        prepared = prepare(args, world_size)
    except INPUT_ERRORS as e:  # what a launch's prepare() reports
        print(f"error: {e}", file=sys.stderr)
        return 2
    unit = prepared.config.sample_unit
    print(f"inputs checked for {world_size} processes: {len(prepared.dataset)} {unit}"
          + (f", {len(prepared.val_dataset)} validation {unit}" if prepared.val_dataset is not None else ""), flush=True)
    return 0


ERROR_FILE_VARIABLE = "MEGATRON_RLHF_ERROR_FILE"


def report_and_exit(error: Any, printed_here: bool) -> None:
    """One line on stderr, no traceback, exit status 2. Ranks that do not print wait a moment
    first: torchrun stops every rank when the first one exits, and the rank that prints must not
    be stopped before it has."""
    if printed_here:
        print(f"error: {error}", file=sys.stderr, flush=True)
        if os.environ.get(ERROR_FILE_VARIABLE):  # the launcher repeats it after torchrun's own report
            with open(os.environ[ERROR_FILE_VARIABLE], "a", encoding="utf-8") as f:
                f.write(f"error: {error}\n")
    else:
        time.sleep(5)
    sys.exit(2)


def die_with_parent() -> None:
    """Linux: this process is killed (SIGKILL) when its parent dies."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the request was made
        os.kill(os.getpid(), signal.SIGKILL)


def _end_with_the_launcher() -> None:
    """Under torchrun (Linux): this rank is killed when its launcher dies (kill -9 of torchrun would
    otherwise leave ranks running, writing checkpoints that a relaunch then races)."""
    if "LOCAL_RANK" in os.environ and sys.platform.startswith("linux"):
        die_with_parent()


def main(argv=None) -> Optional[list]:
    _end_with_the_launcher()
    args = parse_args(argv)
    hide_internal_warnings()
    if args.explain:
        sys.exit(_explain(args.explain))
    if args.dry_run:
        sys.exit(_dry_run(args))
    if args.check_only:
        sys.exit(_check_only(args))
    try:
        return _main(args)
    except KeyboardInterrupt:  # Ctrl-C: every rank gets it; one says so, none prints a traceback
        from megatron_rlhf.startup import launch_rank0

        if launch_rank0():
            print("interrupted (Ctrl-C); the last checkpoint is kept: --resume continues from it", file=sys.stderr,
                  flush=True)
        sys.exit(130)


def _main(args: argparse.Namespace) -> Optional[list]:
    from megatron_rlhf.checkpoint.run_state import restore_set_aside
    from megatron_rlhf.startup import INPUT_ERRORS, launch_rank0, prepare

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        prepared = prepare(args, world_size)
    except INPUT_ERRORS as e:  # the same input on every rank: one per node says it
        report_and_exit(e, int(os.environ.get("LOCAL_RANK", "0")) == 0)
    try:
        from megatron_rlhf.run_loop import run

        return run(prepared)
    except BaseException as e:
        if launch_rank0() and restore_set_aside(prepared.output_dir):
            print(f"{prepared.output_dir}: the run --overwrite set aside is back in place", file=sys.stderr, flush=True)
        if not isinstance(e, Exception):
            raise
        from megatron_rlhf.checkpoint.model_files import CheckpointError
        from megatron_rlhf.errors import RunError

        if not isinstance(e, (RunError, CheckpointError)):
            raise
        # A non-finite step is decided by all ranks together: rank 0 says it. Any other fault is
        # this rank's own (a file it reads, its replica's rewards): the first rank of its
        # model-parallel group says it, naming the rank when there are several.
        from megatron.core import parallel_state as ps

        rank = int(os.environ.get("RANK", "0"))
        if getattr(e, "collective", False):
            report_and_exit(e, rank == 0)
        first = ps.get_model_parallel_group().rank() == 0 if ps.model_parallel_is_initialized() else True
        report_and_exit(f"(rank {rank}) {e}" if world_size > 1 else e, first)


if __name__ == "__main__":
    main()
