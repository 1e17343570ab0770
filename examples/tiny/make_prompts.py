"""Write the demo's synthetic prompt set: short strings of lowercase words, one JSON object per line.

    python examples/tiny/make_prompts.py examples/tiny/prompts.jsonl
"""

import argparse
import json
import random


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    with open(args.output, "w", encoding="utf-8") as f:
        for _ in range(args.count):
            words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 5))) for _ in range(rng.randint(1, 3))]
            f.write(json.dumps({"prompt": " ".join(words) + " "}) + "\n")


if __name__ == "__main__":
    main()
