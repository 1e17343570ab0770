"""Generation benchmark: our engine against Hugging Face transformers' generate(), side by side in
one run, on the same random Llama weights (written by transformers, converted with the project's
converter), greedy, prompts of spread lengths, response lengths spread by EOS.

    python bench/generation.py                      # 64 prompts of 16-512 tokens, 128 new tokens
    python bench/generation.py --prompts 16 --max-prompt 96 --new-tokens 48 --json out.json

Prints useful tokens/s of each and their ratio, forward passes per useful token, the share of
decode slot-steps that produced a useful token, and whether the greedy outputs agree row by row;
then computed / useful tokens of the scoring and training passes over the rollout generated.
On CUDA also the decode step time against the weight-read limit (weight bytes / memory bandwidth)
at batch 1 and at the batch used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_rlhf.checkpoint import load_model_shard  # noqa: E402
from megatron_rlhf.checkpoint.convert import hf_to_megatron  # noqa: E402
from megatron_rlhf.checkpoint.model_files import read_model_meta  # noqa: E402
from megatron_rlhf.config.schema import ParallelConfig  # noqa: E402
from megatron_rlhf.generation import SamplingParams, generate  # noqa: E402
from megatron_rlhf.models.batches import length_grouped  # noqa: E402
from megatron_rlhf.models.decoder import build_model, load_local_state_dict  # noqa: E402
from megatron_rlhf.runtime import destroy_distributed, get_platform, init_distributed  # noqa: E402

PAD = 0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--slots", type=int, default=32, help="our decode slots (generation.batch_size)")
    p.add_argument("--hf-batch", type=int, help="rows per transformers generate() call (default: all prompts)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--micro-batch-size", type=int, default=4, help="of the scoring and training passes")
    p.add_argument("--step-rows", type=int, default=16, help="rows per optimizer step of the training pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args()


def random_llama(args, directory: str):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, num_hidden_layers=args.layers, vocab_size=args.vocab,
        max_position_embeddings=args.max_prompt + args.new_tokens, rms_norm_eps=1e-5,
        tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


def choose_eos(ours, prompts, lengths, args) -> int:
    """The token that first appears within the first half of the most greedy responses (a pilot
    run of our engine without EOS on a few prompts): random weights have no end token of their
    own, and this one ends rows at spread lengths."""
    pilot = min(16, len(lengths))
    gen = generate(ours, prompts[:pilot], lengths[:pilot], SamplingParams(args.new_tokens, greedy=True, pad_id=PAD),
                   args.vocab, batch_size=args.slots)
    rows_with = {}
    for row in range(pilot):
        response = gen.tokens[row, int(lengths[row]) : int(gen.total_lengths[row])].tolist()
        for token in set(response[4 : args.new_tokens // 2]):
            rows_with[token] = rows_with.get(token, 0) + 1
    return max(rows_with, key=lambda t: (rows_with[t], -t))


def hf_generate(model, prompts, lengths, eos, args):
    """transformers' greedy generate over left-padded batches; returns the responses and the
    number of forward calls."""
    calls = [0]
    handle = model.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    batch = args.hf_batch or len(lengths)
    responses = []
    try:
        for i in range(0, len(lengths), batch):
            part, n = prompts[i : i + batch], lengths[i : i + batch]
            width = int(n.max())
            left = torch.full((len(n), width), PAD, dtype=torch.long)
            mask = torch.zeros(len(n), width, dtype=torch.long)
            for row, k in enumerate(n.tolist()):
                left[row, width - k :] = part[row, :k]
                mask[row, width - k :] = 1
            with torch.no_grad():
                out = model.generate(left, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                     eos_token_id=eos, pad_token_id=PAD)
            for row in range(len(n)):
                responses.append(_until_eos(out[row, width:].tolist(), eos))
    finally:
        handle.remove()
    return responses, calls[0]


def pass_padding(gen, args):
    """Computed tokens / useful (real) tokens of the passes after generation over this rollout,
    with micro-batches grouped by length and trimmed (as roles/inference.py and the controller's
    training cut them) and, for comparison, padded to the rollout's longest row."""
    lengths = gen.total_lengths.cpu()
    useful = int(lengths.sum())

    def computed(rows):
        batches, _ = length_grouped(args.micro_batch_size, lengths[rows], tokens=gen.tokens.cpu()[rows])
        return sum(mb["tokens"].numel() for mb in batches)

    everything = torch.arange(len(lengths))
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(args.seed))
    training = sum(computed(order[i : i + args.step_rows]) for i in range(0, len(lengths), args.step_rows))
    return {"scoring_computed_per_useful_token": computed(everything) / useful,
            "training_computed_per_useful_token": training / useful,
            "padded_to_longest_row_computed_per_useful_token": gen.tokens.numel() / useful}


def _until_eos(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def main():
    args = parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    init_distributed(ParallelConfig(1, 1), seed=args.seed)
    device = get_platform().device
    with tempfile.TemporaryDirectory() as tmp:
        hf = random_llama(args, os.path.join(tmp, "hf"))
        hf_to_megatron(os.path.join(tmp, "hf"), os.path.join(tmp, "mg"))
        arch, meta = read_model_meta(os.path.join(tmp, "mg"))
        ours = build_model(arch, ParallelConfig(1, 1), "lm", precision=args.precision)
        load_local_state_dict(ours, load_model_shard(os.path.join(tmp, "mg"), arch, "lm", 1, 0, 1, 0))
    hf = hf.to(device=device, dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32)

    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.prompts,), generator=g)
    prompts = torch.randint(3, args.vocab, (args.prompts, int(lengths.max())), generator=g)
    eos = choose_eos(ours, prompts, lengths, args)
    params = SamplingParams(args.new_tokens, greedy=True, eos_ids=(eos,) if eos is not None else (), pad_id=PAD)

    generate(ours, prompts[:2, :8], torch.tensor([8, 5]), SamplingParams(4, greedy=True, pad_id=PAD), args.vocab)  # warm-up
    get_platform().synchronize()
    started = time.perf_counter()
    gen = generate(ours, prompts, lengths, params, args.vocab, batch_size=args.slots)
    get_platform().synchronize()
    ours_s = time.perf_counter() - started
    ours_rows = [gen.tokens[r, int(lengths[r]) : int(gen.total_lengths[r])].tolist() for r in range(args.prompts)]

    started = time.perf_counter()
    hf_rows, hf_calls = hf_generate(hf, prompts.to(device), lengths, eos, args)
    get_platform().synchronize()
    hf_s = time.perf_counter() - started

    useful = sum(len(r) for r in ours_rows)
    response_lengths = sorted(len(r) for r in ours_rows)
    same = sum(a == b for a, b in zip(ours_rows, hf_rows))
    s = gen.stats
    figures = {
        "workload": {"prompts": args.prompts, "prompt_tokens": f"{args.min_prompt}-{args.max_prompt}",
                     "new_tokens": args.new_tokens, "eos": eos, "response_lengths_min_median_max":
                     [response_lengths[0], response_lengths[len(response_lengths) // 2], response_lengths[-1]],
                     "model": f"h{args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), "
                              f"ffn {args.ffn}, vocab {args.vocab}, {args.precision}", "device": str(device),
                     "slots": args.slots, "hf_batch": args.hf_batch or args.prompts},
        "ours_useful_tokens_per_s": useful / ours_s,
        "transformers_useful_tokens_per_s": sum(len(r) for r in hf_rows) / hf_s,
        "ratio": (useful / ours_s) / (sum(len(r) for r in hf_rows) / hf_s),
        "ours_seconds": ours_s, "transformers_seconds": hf_s,
        "ours_forward_passes_per_useful_token": s.forward_passes / useful,
        "transformers_forward_passes_per_useful_token": hf_calls / useful,
        "decode_occupancy_of_rows_computed": s.useful / s.sampled,
        "decode_occupancy_of_all_slots": s.useful / s.slot_steps,
        "computed_tokens_per_useful_token": s.computed_tokens / useful,
        "greedy_rows_identical": f"{same}/{args.prompts}",
        **pass_padding(gen, args),
    }
    for key, value in figures.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    destroy_distributed()


if __name__ == "__main__":
    main()
