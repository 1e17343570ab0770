"""Compare two runs' metrics.jsonl row by row, every key but the wall times (time/*) and how the
work was scheduled (rollout/record.py's SCHEDULE_METRICS): the invariance check of EMS on against off. Exit status 1, naming the first difference, if they differ.

    python bench/gpu/compare_runs.py RUN_A RUN_B
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megatron_rlhf.rollout.record import SCHEDULE_METRICS  # noqa: E402


def metrics(run_dir: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in row.items() if not k.startswith("time/") and k not in SCHEDULE_METRICS} for row in rows]


def main() -> int:
    a, b = (metrics(d) for d in sys.argv[1:3])
    if len(a) != len(b):
        print(f"different lengths: {len(a)} and {len(b)} rows")
        return 1
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            key = next(k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k))
            print(f"row {i} (iteration {x.get('iteration')}): {key} = {x.get(key)} against {y.get(key)}")
            return 1
    print(f"identical: {len(a)} rows, every key but time/* and {', '.join(SCHEDULE_METRICS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
