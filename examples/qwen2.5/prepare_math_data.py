#!/usr/bin/env python3
"""Turn locally downloaded GSM8K or MATH Parquet files into megatron-rlhf's prompt rows (no
download here): a chat ``prompt`` (one user message: the problem and how to state the answer),
``ground_truth``, ``data_source`` (gsm8k or math) and ``extra_info`` (split, index).

    python examples/qwen2.5/prepare_math_data.py gsm8k gsm8k/main/train-00000-of-00001.parquet data/gsm8k_train.parquet
    python examples/qwen2.5/prepare_math_data.py math  competition_math/test.parquet data/math_test.parquet

GSM8K rows have ``question`` and ``answer`` (its last line "#### 42"); MATH rows have ``problem``
and ``solution`` (its last ``\\boxed{...}``). A row whose answer cannot be read is an error naming it.
"""

import argparse
import os
import sys

from megatron_rlhf.rewards.verifiers import last_boxed

INSTRUCTIONS = {
    "gsm8k": "Let's think step by step and output the final answer after \"####\".",
    "math": "Let's think step by step and output the final answer within \\boxed{}.",
}


def convert_row(kind: str, row: dict, index: int, split: str, source: str) -> dict:
    if kind == "gsm8k":
        question, answer = row["question"], row["answer"].rsplit("####", 1)
        truth = answer[1].strip().replace(",", "") if len(answer) == 2 else None
    else:
        question, truth = row["problem"], last_boxed(row["solution"])
    if not truth:
        raise ValueError(f"{source}: row {index + 1}: no final answer in its {'answer' if kind == 'gsm8k' else 'solution'}")
    return {"prompt": [{"role": "user", "content": f"{question} {INSTRUCTIONS[kind]}"}], "ground_truth": truth,
            "data_source": kind, "extra_info": {"split": split, "index": index}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=sorted(INSTRUCTIONS))
    p.add_argument("source", help="the downloaded Parquet file")
    p.add_argument("output", help="the Parquet file to write")
    p.add_argument("--split", help="extra_info.split [from the file name: train or test]")
    args = p.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq

    split = args.split or ("test" if "test" in os.path.basename(args.source) else "train")
    try:
        rows = pq.read_table(args.source).to_pylist()
        converted = [convert_row(args.kind, row, i, split, args.source) for i, row in enumerate(rows)]
    except (ValueError, KeyError, OSError) as e:
        print(f"error: {args.source}: {e}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(converted), args.output)
    print(f"wrote {args.output}: {len(converted)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
