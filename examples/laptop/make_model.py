"""A tiny random Qwen2 model in Hugging Face's format, with the tiny math demo's tokenizer and chat
template: it stands in for the model you would download (Qwen2.5-0.5B-Instruct, say), so that the
laptop walkthrough (docs/guide/walkthrough.md) runs end to end in seconds and offline.

    python examples/laptop/make_model.py laptop/model
"""

import argparse
import os
import sys

TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tiny_math", "tokenizer")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the Hugging Face model directory to write (config.json, weights, tokenizer)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' random seed")
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if os.path.exists(args.output):
        print(f"error: {args.output} exists; choose another directory", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(args.seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
