"""Plan a run's device memory before launching it: ``python -m megatron_rlhf.plan --config rlhf.yaml
[--world-size N] [--gpu-memory 80GiB]``. Needs no GPU and builds no model."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Optional, Tuple

from megatron_rlhf.config import RLHFConfig, load_config, validate
from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.memory.planner import KINDS, TRANSIENT, Plan, plan, recommend

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 80GiB, 40GB or 1073741824")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_plan(p: Plan) -> str:
    cols = KINDS[:-1] + TRANSIENT
    lines = [f"layout: TP={p.layout['tp']} PP={p.layout['pp']} DP={p.layout['dp']}, sequence {p.layout['seq']} tokens; "
             "per GPU, most loaded pipeline stage"]
    lines.append(f"{'role':<11}" + "".join(f"{c:>17}" for c in cols))
    for role, kinds in p.roles.items():
        row = {**kinds, **p.transient[role]}
        lines.append(f"{role:<11}" + "".join(f"{human(row.get(c, 0)):>17}" for c in cols))
    lines.append("")
    lines.append("phase          resident on the device")
    for phase, total in p.phases.items():
        mark = "  <- peak" if phase == p.peak_phase else ""
        lines.append(f"{phase:<14} {human(total):>12}{mark}")
    return "\n".join(lines)


def load_for_planning(config_file: str, world_size: Optional[int] = None) -> Tuple[RLHFConfig, int]:
    """The config validated for ``world_size`` (default: TP*PP), and that world size. The files it
    names are not checked: planning needs none of them."""
    config = load_config(config_file, check_inputs=False)
    par = config.parallel
    world_size = world_size or par.tensor_model_parallel_size * par.pipeline_model_parallel_size
    validate(config, world_size, check_inputs=False)
    return config, world_size


def memory_report(config, world_size: int, gpu_memory: Optional[int] = None,
                  seq_length: Optional[int] = None) -> Tuple[str, bool]:
    """The per-role table and the phases with the configured EMS switches, and with ``gpu_memory``
    the least offloading that fits. Returns (text, whether it fits: True without a budget)."""
    lines = ["with the configured EMS switches:", format_plan(plan(config, world_size, seq_length=seq_length))]
    if not gpu_memory:
        return "\n".join(lines), True
    switches, fitted = recommend(config, world_size, gpu_memory, seq_length)
    lines.append("")
    if switches is None:
        lines.append(f"does not fit in {human(gpu_memory)}: even with every role offloaded the peak is "
                     f"{human(fitted.peak_bytes)} ({fitted.peak_phase}), {human(fitted.peak_bytes - gpu_memory)} over; "
                     "raise TP/PP, enable recompute_activations or lower micro-batch and sequence sizes")
        return "\n".join(lines), False
    on = [f"{role}: {', '.join(s.kinds())}" for role, s in switches.items() if s.kinds()]
    lines.append(f"fits in {human(gpu_memory)} with peak {human(fitted.peak_bytes)} ({fitted.peak_phase}) "
                 f"when these leave the device while idle: {'; '.join(on) if on else 'nothing'}")
    return "\n".join(lines), True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megatron_rlhf.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int, default=None, help="GPUs in the job (default: TP*PP)")
    parser.add_argument("--gpu-memory", type=parse_bytes, help="device memory per GPU, e.g. 80GiB: recommend the least offloading that fits")
    parser.add_argument("--seq-length", type=int, help="default: data.max_prompt_length + generation.max_new_tokens")
    args = parser.parse_args(argv)
    try:
        config, world = load_for_planning(args.config, args.world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text, fits = memory_report(config, world, args.gpu_memory, args.seq_length)
    print(text)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
