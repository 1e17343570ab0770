"""Write the judge demo's data: ratings for the judge's SFT, and prompts for GRPO.

The judge learns to rate an answer from 0 to 9 by the hidden rule of the pipeline demo (the share of
vowels among the answer's characters, examples/tiny_pipeline/make_data.vowel_share): each row is the
judge's template (judge_template.txt) filled with a prompt and an answer, and the rating as the
completion. The answers span what the policy writes: from an untrained model's (any character of the
alphabet) to all vowels. GRPO then never sees the rule, only the judge's verdicts.

    python examples/tiny_judge/make_data.py examples/tiny_judge
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tiny_pipeline"))
from make_data import vowel_share, words  # noqa: E402  (the pipeline demo's rule and prompts)

from megatron_rlhf.rewards.verdicts import fill_template  # noqa: E402

ALPHABET = "abcdefghijklmnopqrstuvwxyz 0123456789|"  # judge.yaml's tokenizer
VOWELS = "aeiou"
MAX_ANSWER = 16  # grpo.yaml's generation.max_new_tokens


def answer(rng: random.Random) -> str:
    """An answer of 1 to MAX_ANSWER characters: a vowel with a chance drawn per answer, else any other
    character of the alphabet (the vowel share spread over [0, 1])."""
    p = rng.random()
    others = [c for c in ALPHABET if c not in VOWELS]
    return "".join(rng.choice(VOWELS) if rng.random() < p else rng.choice(others)
                   for _ in range(rng.randint(1, MAX_ANSWER)))


def rating(text: str) -> str:
    return str(round(9 * vowel_share(text)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with open(os.path.join(args.directory, "judge_template.txt"), encoding="utf-8") as f:
        template = f.read()

    def rows(count: int):
        for _ in range(count):
            prompt, text = words(rng, 1, 3) + " ", answer(rng)
            yield {"prompt": fill_template(template, prompt, text, ""), "completion": rating(text)}

    def write(name: str, lines) -> None:
        with open(os.path.join(args.directory, name), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)

    write("ratings.jsonl", rows(4096))
    write("ratings_val.jsonl", rows(256))
    write("prompts.jsonl", ({"prompt": words(rng, 1, 3) + " "} for _ in range(512)))


if __name__ == "__main__":
    main()
