"""Routing replay on the tiny MoE demo (examples/tiny/moe.yaml): the same run with moe.routing_replay
off, rollout and old_logprob, side by side. Per mode: mean |ratio - 1| and the clip fraction of the
PPO epoch (ppo_epochs is 1, so every iteration's epoch is a first one), in the first iteration (the
same rollout and weights in every mode: only the training forwards differ) and over the run, and
with replay the share of replayed token routings the router would have moved.

    python bench/routing_replay.py                      # the demo's settings
    python bench/routing_replay.py --lr 2e-3 --rollout-precision bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODES = ("off", "rollout", "old_logprob")


def run(mode: str, args, out_dir: str) -> list:
    env = dict(os.environ, ROUTING_REPLAY=mode, OUTPUT_DIR=out_dir, ITERATIONS=str(args.iterations),
               POLICY_LR=str(args.lr), ROLLOUT_PRECISION=args.rollout_precision, OMP_NUM_THREADS="1",
               TENSORBOARD="False")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "megatron_rlhf.train",
           "--config", "examples/tiny/moe.yaml", "--overwrite"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{mode}: {' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if '"policy/ratio_dev"' in line]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--lr", type=float, default=5e-4, help="ppo_policy's learning rate (the demo's: 5e-4)")
    p.add_argument("--rollout-precision", choices=("fp32", "bf16"), default="fp32",
                   help="the policy's (generation and old log-probs); training is fp32")
    args = p.parse_args()
    print(f"tiny MoE demo, {args.iterations} iterations, lr {args.lr:g}, rollouts in {args.rollout_precision}, "
          "4 optimizer steps per epoch")
    print(f"{'replay':12} {'|ratio-1| it1':>14} {'clip it1':>9} {'|ratio-1| all':>14} {'clip all':>9} "
          f"{'moved it1':>10} {'moved all':>10} {'reward last5':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            rows = run(mode, args, os.path.join(tmp, mode))
            first = rows[0]

            def mean(key):
                return statistics.mean(r[key] for r in rows)

            moved = ("-", "-") if mode == "off" else (f"{first['policy/moe/replay_moved']:.4f}",
                                                      f"{mean('policy/moe/replay_moved'):.4f}")
            print(f"{mode:12} {first['policy/ratio_dev']:14.5f} {first['policy/clipfrac']:9.5f} "
                  f"{mean('policy/ratio_dev'):14.5f} {mean('policy/clipfrac'):9.5f} {moved[0]:>10} {moved[1]:>10} "
                  f"{statistics.mean(r['reward/mean'] for r in rows[-5:]):13.3f}", flush=True)


if __name__ == "__main__":
    main()
