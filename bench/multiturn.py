"""Multi-turn generation: the engine's KV cache kept across turns against prefilling every turn's
whole prefix again (what a loop that re-tokenises the conversation each turn costs), side by side
in one run, on the same random Llama weights (written by transformers, converted with the
project's converter), greedy, no end token (every turn runs to its length).

Each trajectory writes the same number of model tokens in 1, 4 or 16 turns (``--model-tokens``
split evenly); between turns a fixed reply of ``--reply`` tokens is appended (the environment's
answer). Prints, per turn count and side: seconds, model tokens/s, positions fed per model token,
and the cost per model token relative to one turn (the goal: at 16 turns within 1.3x with the
cache kept), and per trajectory token (the model's and the replies': the replies' prefill is work
the one-turn run does not have); and whether both sides wrote the same tokens.

    python bench/multiturn.py                          # 32 trajectories, 64-token prompts, 192 model tokens
    python bench/multiturn.py --turns 1 8 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from generation import PAD, add_model_arguments, converted_llama, timed  # noqa: E402

from megatron_rlhf.config.schema import ParallelConfig  # noqa: E402
from megatron_rlhf.generation import CacheSession, SamplingParams, generate  # noqa: E402
from megatron_rlhf.runtime import destroy_distributed, get_platform, init_distributed  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of every trajectory")
    p.add_argument("--model-tokens", type=int, default=192, help="the model's tokens per trajectory, over all turns")
    p.add_argument("--reply", type=int, default=8, help="tokens of the environment's reply between turns")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating; the median is reported")
    add_model_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args()
    bad = [t for t in args.turns if t < 1 or args.model_tokens % t]
    if bad:
        p.error(f"--turns {bad}: each turn count must be >= 1 and divide --model-tokens {args.model_tokens}")
    return args


def rollout(model, prompts: torch.Tensor, replies: torch.Tensor, turns: int, keep_cache: bool, args):
    """Every trajectory's tokens after ``turns`` turns and the positions the engine fed."""
    rows = [row.tolist() for row in prompts]
    params = SamplingParams(args.model_tokens // turns, greedy=True, pad_id=PAD)
    context = args.prompt + args.model_tokens + (turns - 1) * args.reply
    session = CacheSession(len(rows), context) if keep_cache else None
    fed = 0
    for turn in range(turns):
        width = max(map(len, rows))
        batch = torch.tensor([row + [PAD] * (width - len(row)) for row in rows])
        g = generate(model, batch, torch.tensor([len(row) for row in rows]), params, args.vocab, cache_length=context,
                     session=session, keys=list(range(len(rows))) if session else None)
        fed += g.stats.computed_tokens
        for r, row in enumerate(rows):
            row += g.tokens[r, len(row) : len(row) + int(g.response_lengths[r])].tolist()
            if turn < turns - 1:
                row += replies[r, turn].tolist()
    if session is not None:
        session.close()
    return rows, fed


def measure(model, turns: int, args) -> dict:
    g = torch.Generator().manual_seed(args.seed + turns)
    prompts = torch.randint(3, args.vocab, (args.trajectories, args.prompt), generator=g)
    replies = torch.randint(3, args.vocab, (args.trajectories, max(turns - 1, 1), args.reply), generator=g)
    times = {"kept": [], "prefilled": []}
    out = {}
    for _ in range(args.repeats):
        for side in times:
            out[side], seconds = timed(lambda: rollout(model, prompts, replies, turns, side == "kept", args))
            times[side].append(seconds)
    model_tokens = args.trajectories * args.model_tokens
    figures = {"turns": turns, "same_tokens": out["kept"][0] == out["prefilled"][0],
               "trajectory_tokens_per_model_token": (args.model_tokens + (turns - 1) * args.reply) / args.model_tokens}
    for side, seconds in times.items():
        median = sorted(seconds)[args.repeats // 2]
        figures[f"{side}_s"] = median
        figures[f"{side}_model_tokens_per_s"] = model_tokens / median
        figures[f"{side}_fed_per_model_token"] = out[side][1] / model_tokens
    return figures


def main():
    args = parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    init_distributed(ParallelConfig(1, 1), seed=args.seed)
    longest = args.prompt + args.model_tokens + (max(args.turns) - 1) * args.reply
    _, model = converted_llama(args, longest)
    generate(model, torch.randint(3, args.vocab, (2, 8)), torch.tensor([8, 5]), SamplingParams(4, greedy=True, pad_id=PAD),
             args.vocab)  # warm-up
    results = [measure(model, turns, args) for turns in sorted(args.turns)]
    one = results[0]
    print(f"{args.trajectories} trajectories, {args.prompt}-token prompts, {args.model_tokens} model tokens each, "
          f"{args.reply}-token replies; model h{args.hidden}, {args.layers} layers, {args.precision}, "
          f"{get_platform().device}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("\n| turns | cache kept: model tokens/s | fed per model token | cost per model token vs 1 turn "
          "| per trajectory token | prefix prefilled every turn: model tokens/s | fed per model token "
          "| cost per model token vs 1 turn | kept vs prefilled | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        r["kept_cost_vs_first"] = r["kept_s"] / one["kept_s"]
        r["kept_cost_per_trajectory_token_vs_first"] = r["kept_cost_vs_first"] / r["trajectory_tokens_per_model_token"]
        r["prefilled_cost_vs_first"] = r["prefilled_s"] / one["kept_s"]
        print(f"| {r['turns']} | {r['kept_model_tokens_per_s']:.0f} | {r['kept_fed_per_model_token']:.2f} | "
              f"{r['kept_cost_vs_first']:.2f}x | {r['kept_cost_per_trajectory_token_vs_first']:.2f}x | "
              f"{r['prefilled_model_tokens_per_s']:.0f} | "
              f"{r['prefilled_fed_per_model_token']:.2f} | {r['prefilled_cost_vs_first']:.2f}x | "
              f"{r['prefilled_s'] / r['kept_s']:.2f}x faster | {r['same_tokens']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    destroy_distributed()


if __name__ == "__main__":
    main()
