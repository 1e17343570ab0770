#!/usr/bin/env python3
"""Convert a Megatron checkpoint (any TP/PP, written by convert_hf_to_megatron.py or by a PPO run)
to a Hugging Face directory of its family (config.json naming the family's model_type and class,
safetensors files and their index).

    python tools/convert_megatron_to_hf.py --megatron-dir ckpt/llama2-7b-tp2pp1 --output Llama-2-7b-rlhf \
        --tokenizer Llama-2-7b-hf     # copies its tokenizer files and generation_config.json too

A run with LoRA (ppo_policy.lora) checkpoints its base and adapters: --merge-lora writes the weights
with the adapters merged (W + alpha/rank B A); --peft-output DIR writes the adapters as a PEFT
adapter directory (peft's PeftModel.from_pretrained(base, DIR) loads it onto the Hugging Face base):

    python tools/convert_megatron_to_hf.py --megatron-dir out/checkpoints/iter_0000100/ppo_policy \
        --peft-output qwen-lora-adapter --base-model Qwen/Qwen2.5-7B-Instruct
"""

import argparse
import os
import sys

from megatron_rlhf.checkpoint.convert import DTYPES, megatron_to_hf
from megatron_rlhf.checkpoint.peft import write_peft_adapter
from megatron_rlhf.checkpoint.model_files import CheckpointError
from megatron_rlhf.config.validation import not_a_model_checkpoint


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-dir", required=True, help="a model checkpoint directory (with megatron_rlhf_model.json)")
    p.add_argument("--output", help="the Hugging Face directory to write (must not exist)")
    p.add_argument("--merge-lora", action="store_true", help="a LoRA checkpoint: write the adapters merged into the weights")
    p.add_argument("--peft-output", help="a LoRA checkpoint: write its adapters as a PEFT adapter directory here")
    p.add_argument("--base-model", help="the base's name or path, recorded in the PEFT adapter's config")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's own")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--tokenizer", help="a Hugging Face directory whose tokenizer files, chat template and "
                                       "generation_config.json are copied in, so the output can generate on its own")
    args = p.parse_args(argv)
    if not args.output and not args.peft_output:
        p.error("name --output (a Hugging Face directory), --peft-output (a PEFT adapter directory) or both")
    if not os.path.isfile(os.path.join(args.megatron_dir, "megatron_rlhf_model.json")):
        print(f"error: --megatron-dir: {not_a_model_checkpoint(args.megatron_dir)}", file=sys.stderr)
        return 2
    try:
        # --output first: its checks (a LoRA checkpoint needs --merge-lora) come before anything is written
        if args.output:
            megatron_to_hf(args.megatron_dir, args.output, args.dtype, args.overwrite, args.tokenizer, args.merge_lora)
            print(f"wrote {args.output}")
        if args.peft_output:
            write_peft_adapter(args.megatron_dir, args.peft_output, args.overwrite, args.base_model)
            print(f"wrote {args.peft_output}")
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
