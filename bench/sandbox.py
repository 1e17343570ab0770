"""The Python sandbox's cost per call: the isolated kind (bubblewrap's namespaces, the bounded
tmpfs, no capabilities, seccomp) against unsafe_process (a bare interpreter under the audit hook,
the design before the walls), side by side in one run on the same programs.

Each side runs ``--calls`` calls of each program, one after another and then ``--parallel`` at a
time (the tool environment's max_parallel_calls), alternating sides call by call so that the
machine's drift hits both alike. Prints per side and mode: calls/s, median and p99 latency, and
the isolated side's median over unsafe_process's (the goal: within 2x).

    python bench/sandbox.py                      # 40 calls of each program, 4 in parallel
    python bench/sandbox.py --calls 100 --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import processor  # noqa: E402

from megatron_rlhf.config.schema import SandboxConfig  # noqa: E402
from megatron_rlhf.agents.sandbox import readiness_problem, run_python  # noqa: E402

PROGRAMS = {
    "print": "print(6 * 7)",
    "arithmetic": "print(sum(i * i for i in range(200000)))",
    "files": "for i in range(50):\n    open(f'f{i}', 'w').write(str(i) * 100)\nprint(len(open('f7').read()))",
}
SIDES = {"isolated": SandboxConfig(), "unsafe_process": SandboxConfig(kind="unsafe_process")}


def _timed(code: str, settings: SandboxConfig) -> float:
    started = time.perf_counter()
    result = run_python(code, settings)
    if result.status != "ok":
        raise SystemExit(f"error: {settings.kind}: {code!r} ended {result.status}: {result.output[-300:]}")
    return time.perf_counter() - started


def _figures(seconds, wall: float) -> dict:
    ordered = sorted(seconds)
    return {"calls_per_s": len(seconds) / wall, "median_ms": 1e3 * statistics.median(ordered),
            "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def sequential(code: str, calls: int) -> dict:
    seconds = {side: [] for side in SIDES}
    wall = dict.fromkeys(SIDES, 0.0)
    for _ in range(calls):
        for side, settings in SIDES.items():
            took = _timed(code, settings)
            seconds[side].append(took)
            wall[side] += took
    return {side: _figures(seconds[side], wall[side]) for side in SIDES}


def parallel(code: str, calls: int, width: int) -> dict:
    found = {}
    with concurrent.futures.ThreadPoolExecutor(width) as pool:
        for side, settings in SIDES.items():
            started = time.perf_counter()
            seconds = list(pool.map(lambda _: _timed(code, settings), range(calls)))
            found[side] = _figures(seconds, time.perf_counter() - started)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    problem = readiness_problem(SIDES["isolated"])
    if problem:
        raise SystemExit(f"error: the isolated sandbox cannot run here: {problem}")
    print(f"# {processor()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"{'program':<11} {'mode':<11} {'side':<15} {'calls/s':>8} {'median ms':>10} {'p99 ms':>8} {'median ratio':>13}")
    rows = []
    for name, code in PROGRAMS.items():
        for mode, figures in (("sequential", sequential(code, args.calls)),
                              (f"{args.parallel} at once", parallel(code, args.calls, args.parallel))):
            ratio = figures["isolated"]["median_ms"] / figures["unsafe_process"]["median_ms"]
            for side, f in figures.items():
                shown = f"{ratio:.2f}x" if side == "isolated" else ""
                print(f"{name:<11} {mode:<11} {side:<15} {f['calls_per_s']:>8.1f} {f['median_ms']:>10.1f} "
                      f"{f['p99_ms']:>8.1f} {shown:>13}")
                rows.append({"program": name, "mode": mode, "side": side, **f})
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
