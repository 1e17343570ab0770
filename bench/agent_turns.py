"""Agent turns without lockstep: an environment whose replies take a long-tailed time (most 20 ms,
one in ten 500 ms), multi-turn rollouts of the same trajectories in lockstep (every turn, then
every call) and without it (``rollout.overlap_turns``: a trajectory goes to its environment as its
turn ends and rejoins the running batch when the reply comes), side by side in one run, same
seed, same random Llama weights (written by transformers, converted with the project's converter).

Prints per turn count and side: seconds, model tokens/s, slot occupancy (rows per engine step over
the slots) and the time the engine waited for replies with nothing to run; the speed-up; and
whether both sides wrote the same trajectories token for token (the goal: >= 1.5x at 8 turns, the
same tokens).

    python bench/agent_turns.py                     # 32 trajectories, 4 and 8 turns
    python bench/agent_turns.py --turns 8 --slow-share 0.2 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import textwrap
import time
import types
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from generation import PAD, add_model_arguments, converted_llama  # noqa: E402

from megatron_rlhf.config.schema import ParallelConfig, RLHFConfig  # noqa: E402
from megatron_rlhf.generation import CacheSession, OpenRun, SamplingParams  # noqa: E402
from megatron_rlhf.rollout.multiturn import MultiTurn  # noqa: E402
from megatron_rlhf.runtime import destroy_distributed, get_platform, init_distributed  # noqa: E402

# Replies: latency drawn per (trajectory, turn) from the mix, the text a fixed run of token ids.
ENVIRONMENT = '''
import random, time, zlib

class LongTailed:
    def start(self, row):
        self.prompt = row["prompt"]

    def step(self, turn):
        draw = random.Random(zlib.crc32(f"{{self.prompt}}/{{turn.index}}".encode()))
        time.sleep({slow_s} if draw.random() < {slow_share} else {fast_s})
        return " ".join(str(draw.randrange(3, {vocab})) for _ in range({reply})), False, 0.0, {{}}
'''


class IdTokenizer:
    """Text is token ids written in decimal (the environment answers in ids): what MultiTurn needs."""

    pad_id, eos_ids = PAD, ()

    def encode_text(self, text):
        return [int(x) for x in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


class Collector:
    """What MultiTurn asks of the rollout collector: the policy and an open engine run over it."""

    def __init__(self, model, vocab, context):
        self.roles = {"policy": types.SimpleNamespace(model=model)}
        self.vocab, self.context = vocab, context

    @contextlib.contextmanager
    def open_run(self, rows, params, record_log_probs=False):
        with CacheSession(rows, self.context) as session, OpenRun(self.roles["policy"].model, params, self.vocab,
                                                                  session, record_log_probs=record_log_probs) as run:
            yield run


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, nargs="+", default=[4, 8])
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens of every trajectory")
    p.add_argument("--turn-tokens", type=int, default=16, help="the model's tokens per turn (no end token)")
    p.add_argument("--reply", type=int, default=8, help="tokens of each reply")
    p.add_argument("--fast-s", type=float, default=0.02)
    p.add_argument("--slow-s", type=float, default=0.5)
    p.add_argument("--slow-share", type=float, default=0.1)
    add_model_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args()


def rollout(model, env_spec: str, turns: int, overlap: bool, args):
    """The trajectories' rows and metrics of one multi-turn rollout, and its wall time."""
    config = RLHFConfig()
    config.data.max_prompt_length = args.prompt
    r = config.rollout
    r.max_turns, r.max_tokens_per_turn, r.max_observation_tokens = turns, args.turn_tokens, args.reply
    r.env_workers, r.overlap_turns, r.env_timeout_s = args.trajectories, overlap, 30.0
    multi = MultiTurn(config, IdTokenizer(), env_spec, chat=False)
    g = torch.Generator().manual_seed(args.seed)
    n = args.trajectories
    mine = {"tokens": torch.randint(3, args.vocab, (n, args.prompt), generator=g),
            "prompt_lengths": torch.full((n,), args.prompt), "seeds": torch.arange(n) + 1000 * args.seed,
            "prompt_index": torch.arange(n)}
    texts = [IdTokenizer().decode(row.tolist()) for row in mine["tokens"]]
    params = SamplingParams(args.turn_tokens, temperature=1.0, pad_id=PAD)
    collector = Collector(model, args.vocab, multi.context)
    try:
        multi.run(collector, {k: v[:2] for k, v in mine.items()}, texts[:2], [{}, {}], params)  # workers started
        started = time.perf_counter()
        rows, metrics = multi.run(collector, mine, texts, [{}] * n, params)
        seconds = time.perf_counter() - started
    finally:
        multi.close()
    return rows, metrics, seconds


def main():
    args = parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    init_distributed(ParallelConfig(1, 1), seed=args.seed)
    longest = args.prompt + max(args.turns) * (args.turn_tokens + args.reply)
    _, model = converted_llama(args, longest)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "env.py"), "w") as f:
            f.write(textwrap.dedent(ENVIRONMENT.format(slow_s=args.slow_s, slow_share=args.slow_share,
                                                       fast_s=args.fast_s, vocab=args.vocab, reply=args.reply)))
        results = []
        for turns in sorted(args.turns):
            figures = {"turns": turns}
            outs = {}
            for side, overlap in (("lockstep", False), ("overlap", True)):
                rows, metrics, seconds = rollout(model, os.path.join(tmp, "env.py:LongTailed"), turns, overlap, args)
                outs[side] = rows
                model_tokens = float(rows["action_mask"].sum())
                figures[side] = {"seconds": seconds, "model_tokens_per_s": model_tokens / seconds,
                                 "slot_occupancy": metrics["rollout/slot_occupancy"],
                                 "waited_for_replies_s": metrics["time/env_s"]}
            figures["speed_up"] = figures["overlap"]["model_tokens_per_s"] / figures["lockstep"]["model_tokens_per_s"]
            figures["same_trajectories"] = all(torch.equal(outs["lockstep"][k], outs["overlap"][k])
                                               for k in ("tokens", "action_mask"))
            results.append(figures)
    print(f"{args.trajectories} trajectories, {args.prompt}-token prompts, {args.turn_tokens} model tokens per turn, "
          f"{args.reply}-token replies taking {args.fast_s * 1e3:.0f} ms, or {args.slow_s * 1e3:.0f} ms for "
          f"{args.slow_share:.0%} of them; model h{args.hidden}, {args.layers} layers, {args.precision}, "
          f"{get_platform().device}, {torch.get_num_threads()} threads, sampling at temperature 1")
    print("\n| turns | lockstep: s | model tokens/s | slot occupancy | waited for replies s "
          "| overlap: s | model tokens/s | slot occupancy | waited for replies s | speed-up | same trajectories |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        a, b = r["lockstep"], r["overlap"]
        print(f"| {r['turns']} | {a['seconds']:.2f} | {a['model_tokens_per_s']:.0f} | {a['slot_occupancy']:.2f} | "
              f"{a['waited_for_replies_s']:.2f} | {b['seconds']:.2f} | {b['model_tokens_per_s']:.0f} | "
              f"{b['slot_occupancy']:.2f} | {b['waited_for_replies_s']:.2f} | {r['speed_up']:.2f}x | "
              f"{r['same_trajectories']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    destroy_distributed()


if __name__ == "__main__":
    main()
