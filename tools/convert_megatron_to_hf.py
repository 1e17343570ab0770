#!/usr/bin/env python3
"""Convert a Megatron checkpoint (any TP/PP, written by convert_hf_to_megatron.py or by a PPO run)
to a Hugging Face directory of its family (config.json naming the family's model_type and class,
safetensors files and their index).

    python tools/convert_megatron_to_hf.py --megatron-dir ckpt/llama2-7b-tp2pp1 --output Llama-2-7b-rlhf \
        --tokenizer Llama-2-7b-hf     # copies its tokenizer files and generation_config.json too
"""

import argparse
import sys

from megatron_rlhf.checkpoint.convert import DTYPES, megatron_to_hf
from megatron_rlhf.checkpoint.model_files import CheckpointError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-dir", required=True, help="a model checkpoint directory (with megatron_rlhf_model.json)")
    p.add_argument("--output", required=True, help="the Hugging Face directory to write (must not exist)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's own")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--tokenizer", help="a Hugging Face directory whose tokenizer files, chat template and "
                                       "generation_config.json are copied in, so the output can generate on its own")
    args = p.parse_args(argv)
    try:
        megatron_to_hf(args.megatron_dir, args.output, args.dtype, args.overwrite, args.tokenizer)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
