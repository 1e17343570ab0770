#!/usr/bin/env python3
"""Memory report of a run: a timeline PNG of resident bytes per role and kind across phases (from
OUTPUT_DIR/memory.jsonl), with the planner's prediction beside it when --config is given, and a
short text summary.

    python tools/memory_report.py outputs/demo --config examples/tiny/rlhf.yaml
"""

import argparse
import json
import os
import sys
from collections import defaultdict

from megatron_rlhf.memory.manager import LEDGER_KINDS
from megatron_rlhf.units import human

# Which planner phase each role's onload starts.
PHASE_OF_ROLE = {"policy": "generate", "reference": "reference", "reward": "reward", "value": "value",
                 "ppo_policy": "train_policy", "ppo_value": "train_value"}


def read_ledger(path):
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        sys.exit(f"error: {path}: no memory ledger (run megatron_rlhf.train with this output directory)")
    if not records:
        sys.exit(f"error: {path}: the ledger is empty")
    return records


def timeline(records):
    """moment -> (label, {(role, kind): bytes}, device figures)."""
    moments = {}
    for r in records:
        label, table, _ = moments.setdefault(r["moment"], (f"{r['event']} {r['active_role'] or r['phase']}", {}, r["device"]))
        for kind in LEDGER_KINDS:
            table[(r["role"], kind)] = r["bytes"][kind]
    return [moments[m] for m in sorted(moments)]


def predicted_state(config_path, world_size):
    """Planner's state bytes (no transient memory: the ledger counts state) per phase."""
    from megatron_rlhf.config import load_config
    from megatron_rlhf.memory.planner import plan

    config = load_config(config_path, world_size=world_size)
    p = plan(config, world_size)
    return {phase: sum(v for role in table.values() for k, v in role.items() if k in LEDGER_KINDS)
            for phase, table in p.resident.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("--config", help="the run's config: draw the planner's prediction beside the measurement")
    parser.add_argument("--world-size", type=int, help="for --config (default: TP*PP)")
    parser.add_argument("--png", help="default: OUTPUT_DIR/memory_timeline.png")
    parser.add_argument("--iterations", type=int, default=2, help="iterations to draw (the first ones)")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_ledger(os.path.join(args.output_dir, "memory.jsonl"))
    first_iterations = {r["iteration"] for r in records}
    keep = sorted(first_iterations)[: args.iterations + 1]  # iteration 0: start-up
    drawn = [r for r in records if r["iteration"] in keep]
    moments = timeline(drawn)
    series = sorted({key for _, table, _ in moments for key, v in table.items() if v})
    totals = [sum(table.values()) for _, table, _ in moments]

    fig, ax = plt.subplots(figsize=(12, 5))
    xs = range(len(moments))
    ax.stackplot(xs, [[table.get(key, 0) / 2**20 for _, table, _ in moments] for key in series],
                 labels=[f"{role} {kind}" for role, kind in series], step="post", alpha=0.8)
    if args.config:
        world = args.world_size
        if world is None:
            from megatron_rlhf.config import load_config

            par = load_config(args.config).parallel
            world = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
        predicted = predicted_state(args.config, world)
        points = [predicted.get(PHASE_OF_ROLE.get(label.split(" ", 1)[1], ""), None) if label.startswith("onload") else None
                  for label, _, _ in moments]
        ax.plot([x + 0.5 for x, p in zip(xs, points) if p is not None], [p / 2**20 for p in points if p is not None],
                "k_", markersize=18, markeredgewidth=2, label="planner: state in this phase")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([label for label, _, _ in moments], rotation=90, fontsize=7)
    ax.set_ylabel("resident role state (MiB, rank 0)")
    ax.set_title(f"EMS memory timeline: {args.output_dir}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    png = args.png or os.path.join(args.output_dir, "memory_timeline.png")
    fig.savefig(png, dpi=110)

    peak = max(range(len(totals)), key=totals.__getitem__)
    by_role = defaultdict(int)
    for r in drawn:
        by_role[r["role"]] = max(by_role[r["role"]], r["resident_bytes"])
    largest = max(by_role, key=by_role.get)
    print(f"peak: {human(totals[peak])} of role state at '{moments[peak][0]}'")
    print(f"largest role: {largest} ({human(by_role[largest])} when resident)")
    device = moments[peak][2]
    if "reserved" in device and device.get("reserved"):
        frag = 1 - device.get("allocated", 0) / device["reserved"]
        print(f"fragmentation at the peak: {frag:.1%} of reserved memory not allocated")
    else:
        print("fragmentation: no CUDA allocator figures in this ledger (CPU run: RSS only)")
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
