"""Plan a run's device memory before launching it: ``python -m megatron_rlhf.plan --config rlhf.yaml
[--model-size SIZE] [--world-size N] [--gpu-memory 80GiB]``. Needs no GPU and builds no model.

The memory section of ``megatron_rlhf.train --dry-run`` (dry_run.py), under a shorter name. With
``--model-size`` (or ``MODEL_SIZE`` in the environment) the launcher's defaults for that size apply,
as ``run_ppo.sh`` would launch it (its preset, layout and nodes)."""

from __future__ import annotations

import argparse
import os
import sys

from megatron_rlhf.config import ConfigError
from megatron_rlhf.dry_run import dry_run
from megatron_rlhf.units import parse_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megatron_rlhf.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int, default=None, help="GPUs in the job (default: TP*PP)")
    parser.add_argument("--gpu-memory", type=parse_bytes, help="device memory per GPU, e.g. 80GiB: recommend the least offloading that fits")
    parser.add_argument("--seq-length", type=int, help="default: data.max_prompt_length + generation.max_new_tokens")
    parser.add_argument("--model-size", help="a MODEL_SIZE of the launcher (default: $MODEL_SIZE; none: the config as is)")
    args = parser.parse_args(argv)
    size = args.model_size or os.environ.get("MODEL_SIZE")
    if size:
        from megatron_rlhf.launch import resolve_environment

        env = dict(os.environ, MODEL_SIZE=size)
        problems = resolve_environment(env, os.path.dirname(os.path.abspath(args.config)), os.getcwd())
        if problems:
            print("error: " + "; ".join(problems), file=sys.stderr)
            return 2
        os.environ.update(env)  # the config's ${NAME:default} values read them
        if args.world_size is None:
            args.world_size = int(env["NNODES"]) * int(env["GPUS_PER_NODE"])
    try:
        return dry_run(args.config, args.world_size, gpu_memory=args.gpu_memory, seq_length=args.seq_length, memory_only=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
