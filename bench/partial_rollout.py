"""Partial rollouts on a long-tailed workload: generation seconds per iteration and useful tokens/s
with and without them, side by side in one run, at the same batch size.

The workload: the GRPO demo's tiny model and prompts (examples/tiny/grpo.yaml) sampled at a
temperature so high that every token is about equally likely, so a response ends at each token with
probability ~1/V (V ~ 30 tokens of the char tokenizer): with max_new_tokens 64 most responses are
short and about a tenth run to the limit. ppo_policy's learning rate is 0, so every iteration of both
sides draws from the same distribution. Without partial rollouts an iteration waits for its longest
response; with them (``--over-sample`` x the prompts in flight) it stops once the batch's groups have
ended and resumes the rest next iteration. Useful tokens: the response tokens of the rows trained
(held and dropped ones do not count until they are). Then the GRPO demo itself (40 iterations as
`make demo-grpo` runs it) with and without partial rollouts: the reward's first-5 and last-5 means.

    python bench/partial_rollout.py                    # 16 prompts x 2, 12 iterations a side
    python bench/partial_rollout.py --no-demo --iterations 4 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16, help="ppo.rollout_batch_size")
    p.add_argument("--samples", type=int, default=2, help="generation.samples_per_prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1000.0)
    p.add_argument("--over-sample", type=float, default=2.0)
    p.add_argument("--chunk-tokens", type=int, default=None, help="rollout.partial.chunk_tokens (default: max_new_tokens / 4)")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--iterations", type=int, default=12, help="timed iterations per side (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-demo", action="store_true", help="skip the GRPO demo's reward curves")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args()


def controller(args, partial: bool, directory: str):
    from megatron_rlhf.controller import PPOController
    from megatron_rlhf.memory import MemoryLedger
    from megatron_rlhf.rewards.pool import RewardPool
    from megatron_rlhf.startup import prepare
    from megatron_rlhf.train import parse_args as train_args

    os.environ.update(TP="1", PRECISION="fp32", ROLLOUT_BATCH_SIZE=str(args.prompts), SAMPLES_PER_PROMPT=str(args.samples),
                      MAX_NEW_TOKENS=str(args.max_new_tokens), OVER_SAMPLE=str(args.over_sample), TENSORBOARD="False")
    config_file = "examples/tiny/grpo_partial.yaml" if partial else "examples/tiny/grpo.yaml"
    prepared = prepare(train_args(["--config", os.path.join(REPO, config_file), "--output-dir",
                                   os.path.join(directory, "on" if partial else "off"), "--overwrite"]), 1)
    config = prepared.config
    config.generation.temperature = args.temperature
    config.ppo_policy.lr = 0.0
    config.rollout.partial.chunk_tokens = args.chunk_tokens
    config.rollout.partial.max_staleness = args.max_staleness
    pool = RewardPool(prepared.reward_functions, num_workers=1)
    return PPOController(config, copy.deepcopy(prepared.dataset), prepared.tokenizer, pool, MemoryLedger(None)), pool


def side(args, partial: bool, directory: str) -> dict:
    """Per timed iteration: generation seconds and the response tokens trained."""
    ctl, pool = controller(args, partial, directory)
    rows = args.prompts * args.samples
    seconds, tokens, at_limit, held = [], [], [], []
    try:
        for i in range(args.warmup + args.iterations):
            m = ctl.step()
            if i < args.warmup:
                continue
            seconds.append(m["time/generate_s"])
            tokens.append(m["response/length_mean"] * rows)
            held.append(m.get("rollout/partial_held_groups", 0.0))
    finally:
        pool.close()
    return {"generate_s_per_iteration": statistics.mean(seconds), "useful_tokens": sum(tokens),
            "useful_tokens_per_s": sum(tokens) / sum(seconds), "response_length_mean": sum(tokens) / (rows * len(tokens)),
            "held_groups_mean": statistics.mean(held)}


def demo_rewards(partial: bool, directory: str) -> dict:
    """The GRPO demo (2 processes, as `make demo-grpo`), with or without partial rollouts: the
    reward's first-5 and last-5 means."""
    out = os.path.join(directory, "demo-on" if partial else "demo-off")
    config = "examples/tiny/grpo_partial.yaml" if partial else "examples/tiny/grpo.yaml"
    env = {k: v for k, v in os.environ.items() if k not in ("TP", "ROLLOUT_BATCH_SIZE", "SAMPLES_PER_PROMPT",
                                                            "MAX_NEW_TOKENS", "OVER_SAMPLE", "PRECISION")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "megatron_rlhf.train",
                    "--config", config, "--output-dir", out, "--overwrite"], cwd=REPO, check=True, capture_output=True,
                   env={**env, "OMP_NUM_THREADS": "1", "TENSORBOARD": "False"})
    rewards = [json.loads(line)["reward/mean"] for line in open(os.path.join(out, "metrics.jsonl"))]
    return {"first5": statistics.mean(rewards[:5]), "last5": statistics.mean(rewards[-5:]), "iterations": len(rewards)}


def main():
    args = parse_args()
    from megatron_rlhf.config.schema import ParallelConfig
    from megatron_rlhf.runtime import destroy_distributed, init_distributed

    init_distributed(ParallelConfig(1, 1), seed=1234)
    figures = {"workload": {k: getattr(args, k) for k in ("prompts", "samples", "max_new_tokens", "temperature",
                                                         "over_sample", "chunk_tokens", "max_staleness", "iterations")}}
    with tempfile.TemporaryDirectory() as directory:
        figures["without"] = side(args, False, directory)
        figures["with"] = side(args, True, directory)
        destroy_distributed()
        if not args.no_demo:
            figures["demo_without"] = demo_rewards(False, directory)
            figures["demo_with"] = demo_rewards(True, directory)
    off, on = figures["without"], figures["with"]
    figures["tokens_per_s_ratio"] = on["useful_tokens_per_s"] / off["useful_tokens_per_s"]
    print(f"workload: {args.prompts} prompts x {args.samples} responses, max_new_tokens {args.max_new_tokens}, "
          f"{args.iterations} timed iterations a side (after {args.warmup})")
    for name, f in (("without partial", off), (f"with partial ({args.over_sample:g}x)", on)):
        print(f"  {name:24s} generate {f['generate_s_per_iteration']:.3f} s/iteration | useful "
              f"{f['useful_tokens_per_s']:.0f} tokens/s | response length {f['response_length_mean']:.1f} | "
              f"groups held {f['held_groups_mean']:.1f}")
    print(f"  useful tokens/s with / without: {figures['tokens_per_s_ratio']:.2f}x (goal >= 1.4x)")
    for name in ("demo_without", "demo_with"):
        if name in figures:
            f = figures[name]
            print(f"  GRPO demo {name[5:]:7s} partial: reward first-5 {f['first5']:.3f}, last-5 {f['last5']:.3f} "
                  f"({f['iterations']} iterations)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
