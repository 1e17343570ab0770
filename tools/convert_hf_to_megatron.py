#!/usr/bin/env python3
"""Convert a Hugging Face checkpoint of a supported family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral:
XForCausalLM, or XForSequenceClassification with one label for a reward/value model) to a Megatron
checkpoint at a target TP and PP.

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B-Instruct --output ckpt/qwen2.5-7b-tp2 --tp 2 --pp 1
"""

import argparse
import sys

from megatron_rlhf.checkpoint.convert import DTYPES, hf_to_megatron
from megatron_rlhf.units import positive_int
from megatron_rlhf.checkpoint.model_files import CheckpointError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="directory with config.json and *.safetensors or pytorch_model*.bin")
    p.add_argument("--output", required=True, help="the Megatron checkpoint directory to write (must not exist)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size of the output")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size of the output")
    p.add_argument("--head", choices=("lm", "scalar"), help="default: from config.json's architectures")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's own")
    p.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128,
                   help="the vocabulary is padded to a multiple of this times TP (as Megatron)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = p.parse_args(argv)
    try:
        hf_to_megatron(args.hf_dir, args.output, args.tp, args.pp, args.head, args.dtype,
                       args.make_vocab_size_divisible_by, args.overwrite)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} (TP={args.tp}, PP={args.pp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
