"""The policy at its own layout against the run's, side by side in one run: the tiny PPO demo
(examples/tiny/rlhf.yaml, 2 processes, trained roles at TP=2) with the policy at TP=2 (sharing
ppo_policy's weights) and at TP=1 x DP=2 (served by megatron-core's resharding after every training
phase). Prints per layout: time per iteration, generation time and tokens/s, weight-sync time and
bytes received per rank, and the run's rewards (the same runs but for rounding: same streams).

    python bench/layouts.py [--iterations 20] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"policy TP=2 (the run's layout)": "", "policy TP=1 x DP=2 (its own)": "1"}


def run_demo(policy_tp: str, iterations: int, output_dir: str) -> list:
    env = dict(os.environ, POLICY_TP=policy_tp, ITERATIONS=str(iterations), OUTPUT_DIR=output_dir, TP="2",
               OMP_NUM_THREADS="1", TENSORBOARD="False", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "megatron_rlhf.train",
           "--config", "examples/tiny/rlhf.yaml", "--overwrite"]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def summary(runs: list, rollout: int) -> dict:
    steady = [m for metrics in runs for m in metrics[1:]]  # the first iteration warms up
    tokens = [m["response/length_mean"] * rollout for m in steady]
    return {
        "iteration_s": statistics.median(m["time/iteration_s"] for m in steady),
        "generate_s": statistics.median(m["time/generate_s"] for m in steady),
        "tokens_per_s": statistics.median(t / m["time/generate_s"] for t, m in zip(tokens, steady)),
        "sync_s": statistics.median(m["time/weight_sync_s"] for m in steady),
        "sync_bytes": steady[0]["weight_sync/bytes"],
        "reward_last": runs[0][-1]["reward/mean"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="runs per layout, alternating")
    args = parser.parse_args()
    runs = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, policy_tp in LAYOUTS.items():
                out = os.path.join(tmp, f"{policy_tp or 'run'}_{repeat}")
                runs[name].append(run_demo(policy_tp, args.iterations, out))
    rollout = 32  # examples/tiny/common.yaml: ROLLOUT_BATCH_SIZE x 1 response
    results = {name: summary(r, rollout) for name, r in runs.items()}
    print(f"tiny PPO demo, {args.iterations} iterations x {args.repeats} runs per layout (medians past the first iteration)")
    print(f"{'layout':<32}{'iteration s':>12}{'generate s':>12}{'tokens/s':>10}{'sync s':>9}{'sync bytes/rank':>17}"
          f"{'reward last':>13}")
    for name, r in results.items():
        print(f"{name:<32}{r['iteration_s']:>12.3f}{r['generate_s']:>12.3f}{r['tokens_per_s']:>10.0f}{r['sync_s']:>9.4f}"
              f"{r['sync_bytes']:>17,.0f}{r['reward_last']:>13.3f}")
    same, own = results.values()
    print(f"ratios (own / run's layout): iteration {own['iteration_s'] / same['iteration_s']:.2f}x time, "
          f"generation {own['tokens_per_s'] / same['tokens_per_s']:.2f}x tokens/s")


if __name__ == "__main__":
    main()
