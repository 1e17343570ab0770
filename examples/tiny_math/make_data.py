#!/usr/bin/env python3
"""The tiny verifiable-reward demo's inputs, written into a directory (default: this one):

- ``tokenizer/``: a small BPE tokenizer saved the Hugging Face way (tokenizer.json,
  tokenizer_config.json with a ChatML chat template, generation_config.json naming two end tokens),
  trained here on the problems' own text: a vocabulary of under 128 tokens, so the tiny model's fits;
- ``train.jsonl`` and ``val.jsonl``: chat rows ``{"messages": [...], "ground_truth": "7",
  "data_source": "add" | "sub"}``: sums and differences of small numbers whose answer the
  policy must state as ``#### N`` (the GSM8K convention the verifier reads).

    python examples/tiny_math/make_data.py [DIR]
"""

import json
import os
import random
import sys

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def problems(seed: int):
    """Every a + b and a - b (a >= b) with a, b in 0..4, shuffled: (question, answer, source)."""
    rows = [(f"{a} + {b} = ?", str(a + b), "add") for a in range(5) for b in range(5)]
    rows += [(f"{a} - {b} = ?", str(a - b), "sub") for a in range(5) for b in range(a + 1)]
    random.Random(seed).shuffle(rows)
    return rows


def make_tokenizer(directory, generation_eos=None, vocab_size: int = 120):
    """Train and save the BPE tokenizer (Metaspace: spaces kept on decoding) with its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # The text around the special tokens (the trainer would learn merges of their spelling otherwise).
    corpus = [f"user\n{q}\nassistant\n#### {a}" for q, a, _ in problems(0)]
    corpus += ["system user assistant answer with #### be brief what is the"] * 4
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus * 4, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    if generation_eos:
        ids = [fast.convert_tokens_to_ids(t) for t in generation_eos]
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": ids}, f)
    return directory


def write_rows(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for question, answer, source in rows:
            f.write(json.dumps({"messages": [{"role": "user", "content": question}], "ground_truth": answer,
                                "data_source": source}) + "\n")


def main(directory: str) -> None:
    make_tokenizer(os.path.join(directory, "tokenizer"), generation_eos=["<|im_end|>", "<|endoftext|>"])
    rows = problems(1)
    write_rows(os.path.join(directory, "train.jsonl"), rows)
    write_rows(os.path.join(directory, "val.jsonl"), rows[::3])
    print(f"wrote {directory}/tokenizer, train.jsonl ({len(rows)} problems), val.jsonl ({len(rows[::3])})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
