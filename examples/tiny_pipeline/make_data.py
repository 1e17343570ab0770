"""Write the pipeline demo's data: demonstrations for SFT, preference pairs labelled by a hidden rule
(the labeller prefers the answer with more vowels) for the reward model and DPO, prompts for PPO, and
stepwise solutions labelled step by step by the same rule for a process reward model (prm.yaml).
The reward model never sees the rule, only which of two answers the labeller chose.

    python examples/tiny_pipeline/make_data.py examples/tiny_pipeline
"""

import argparse
import json
import os
import random

LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOWELS = set("aeiou")


def vowel_share(text: str) -> float:
    """The hidden rule: the share of vowels among the answer's characters."""
    return sum(c in VOWELS for c in text) / len(text) if text else 0.0


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join("".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 5))) for _ in range(rng.randint(low, high)))


def pair(rng: random.Random, prompt: str) -> dict:
    """Two answers to ``prompt``; the one with more vowels is chosen, the margin never shown."""
    while True:
        a, b = words(rng, 1, 3), words(rng, 1, 3)
        if abs(vowel_share(a) - vowel_share(b)) > 0.15:  # a labeller who can tell them apart
            break
    chosen, rejected = (a, b) if vowel_share(a) > vowel_share(b) else (b, a)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def stepwise(rng: random.Random, prompt: str) -> dict:
    """A solution of 1 to 4 steps (a word each) to ``prompt``, each labelled right when at least 30% of
    its letters are vowels (the same hidden rule, per step): a process reward model's row (stage prm)."""
    steps = [words(rng, 1, 1) for _ in range(rng.randint(1, 4))]
    return {"prompt": prompt, "completions": steps, "labels": [vowel_share(s) >= 0.3 for s in steps]}


def write(path: str, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [words(rng, 1, 3) + " " for _ in range(768)]
    out = args.directory
    write(os.path.join(out, "sft.jsonl"), ({"prompt": p, "completion": words(rng, 1, 3)} for p in prompts[:256]))
    write(os.path.join(out, "pairs.jsonl"), (pair(rng, p) for p in prompts[256:640]))
    write(os.path.join(out, "pairs_val.jsonl"), (pair(rng, p) for p in prompts[640:768]))
    write(os.path.join(out, "prompts.jsonl"), ({"prompt": p} for p in prompts[:512]))
    steps = random.Random(args.seed + 1)  # its own stream: the files above stay as they were
    write(os.path.join(out, "steps.jsonl"), (stepwise(steps, p) for p in prompts[256:640]))
    write(os.path.join(out, "steps_val.jsonl"), (stepwise(steps, p) for p in prompts[640:768]))


if __name__ == "__main__":
    main()
