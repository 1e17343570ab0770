"""Generation benchmark: our engine against Hugging Face transformers' generate(), side by side in
one run, on the same random Llama weights (written by transformers, converted with the project's
converter), greedy, on one or more workloads:

    small       16 prompts of 8-96 tokens, 48 new, no EOS, 16 slots
    no-eos      32 prompts of 8-384 tokens, 64 new, no EOS, 32 slots
    eos-spread  64 prompts of 16-512 tokens, 128 new, EOS spread by a pilot run, 32 slots

    python bench/generation.py --workload all        # a table of the three
    python bench/generation.py --prompts 16 --max-prompt 96 --new-tokens 48 --json out.json   # one, by hand

Each side runs ``--repeats`` times, alternating; the median is reported. Prints useful tokens/s of
each and their ratio beside the ratio of token positions each computed (transformers: its padded
batch, counted by a hook on its forward; ours: prompts fed once plus one token per decode step),
forward passes per useful token, decode occupancy, whether the greedy outputs agree row by row,
the engine's mean step time and its decode step alone (one more run, timed step by step) against
the memory floor (the weights and KV positions a decode step reads, over the device's copy
bandwidth measured in the same run),
and computed / useful tokens of the scoring and training passes over the rollout generated. On CPU
our engine also runs with torch's F.linear (``ratio_with_torch_linears``): its own linears run
oneDNN on packed weights there (runtime/cpu_linears.py), transformers' run torch's MKL GEMM, so this
second ratio is the like-for-like one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_rlhf.checkpoint import load_model_shard  # noqa: E402
from megatron_rlhf.checkpoint.convert import hf_to_megatron  # noqa: E402
from megatron_rlhf.checkpoint.model_files import read_model_meta  # noqa: E402
from megatron_rlhf.config.schema import ParallelConfig  # noqa: E402
from megatron_rlhf.generation import SamplingParams, generate  # noqa: E402
from megatron_rlhf.generation.generate import EngineStep  # noqa: E402
from megatron_rlhf.memory.planner import decode_step_bytes  # noqa: E402
from megatron_rlhf.models.batches import length_grouped  # noqa: E402
from megatron_rlhf.models.batch_invariant import batch_invariant  # noqa: E402
from megatron_rlhf.models.decoder import build_model, load_local_state_dict, local_state_dict  # noqa: E402
from megatron_rlhf.runtime import destroy_distributed, get_platform, init_distributed  # noqa: E402
from megatron_rlhf.runtime.cpu_linears import KERNEL_VARIABLE, chosen_kernel  # noqa: E402
from machine import processor  # noqa: E402

PAD = 0
WORKLOADS = {
    "small": dict(prompts=16, min_prompt=8, max_prompt=96, new_tokens=48, eos=False, slots=16),
    "no-eos": dict(prompts=32, min_prompt=8, max_prompt=384, new_tokens=64, eos=False, slots=32),
    "eos-spread": dict(prompts=64, min_prompt=16, max_prompt=512, new_tokens=128, eos=True, slots=32),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=(*WORKLOADS, "all"), help="a named workload (its sizes replace the flags below)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating; the median is reported")
    p.add_argument("--no-eos", action="store_true", help="rows run to --new-tokens (no end token)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--slots", type=int, default=32, help="our decode slots (generation.batch_size)")
    p.add_argument("--hf-batch", type=int, help="rows per transformers generate() call (default: all prompts)")
    add_model_arguments(p)
    p.add_argument("--micro-batch-size", type=int, default=4, help="of the scoring and training passes")
    p.add_argument("--step-rows", type=int, default=16, help="rows per optimizer step of the training pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--batch-invariant", action="store_true",
                   help="also run ours in batch-invariant mode (trainer.batch_invariant), alternating, and report its cost")
    return p.parse_args()


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The random Llama's shape and precision (random_llama reads them)."""
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")


def random_llama(args, directory: str, positions: int):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, num_hidden_layers=args.layers, vocab_size=args.vocab,
        max_position_embeddings=positions, rms_norm_eps=1e-5,
        tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


def converted_llama(args, positions: int):
    """The random Llama (transformers') and the same weights as our model, converted by the
    project's converter: (transformers' model, ours)."""
    with tempfile.TemporaryDirectory() as tmp:
        hf = random_llama(args, os.path.join(tmp, "hf"), positions)
        hf_to_megatron(os.path.join(tmp, "hf"), os.path.join(tmp, "mg"))
        arch, _ = read_model_meta(os.path.join(tmp, "mg"))
        ours = build_model(arch, ParallelConfig(1, 1), "lm", precision=args.precision)
        load_local_state_dict(ours, load_model_shard(os.path.join(tmp, "mg"), arch, "lm", 1, 0, 1, 0))
    return hf, ours, arch


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
    """transformers' greedy generate over left-padded batches; returns the responses, the number of
    forward calls and the token positions they computed."""
    calls, positions = [0], [0]

    def count(module, args, kwargs):
        calls[0] += 1
        positions[0] += kwargs["input_ids"].numel() if kwargs.get("input_ids") is not None else args[0].numel()

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
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
    return responses, calls[0], positions[0]


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
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def workloads(args):
    """(name, args of that workload) for each workload asked for."""
    names = list(WORKLOADS) if args.workload == "all" else [args.workload] if args.workload else []
    if not names:
        return [("custom", args)]
    chosen = []
    for name in names:
        w = dict(WORKLOADS[name])
        eos = w.pop("eos")
        chosen.append((name, argparse.Namespace(**{**vars(args), **w, "no_eos": not eos})))
    return chosen


def timed(run):
    """The result of ``run()`` and its wall time, the device synchronised on both sides."""
    get_platform().synchronize()
    started = time.perf_counter()
    result = run()
    get_platform().synchronize()
    return result, time.perf_counter() - started


def median(times: list) -> float:
    return sorted(times)[len(times) // 2]


def compare(ours, arch, hf, w, args, invariant=None) -> dict:
    """Both sides on workload ``w``, alternating run by run; with ``invariant`` (ours built in
    batch-invariant mode), its cost on the same prompts too."""
    device = get_platform().device
    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = torch.randint(w.min_prompt, w.max_prompt + 1, (w.prompts,), generator=g)
    prompts = torch.randint(3, args.vocab, (w.prompts, int(lengths.max())), generator=g)
    eos = None if w.no_eos else choose_eos(ours, prompts, lengths, w)
    params = SamplingParams(w.new_tokens, greedy=True, eos_ids=(eos,) if eos is not None else (), pad_id=PAD)
    run_ours = lambda: generate(ours, prompts, lengths, params, args.vocab, batch_size=w.slots)  # noqa: E731
    ours_times, hf_times, same_kernel_times = [], [], []
    for _ in range(args.repeats):
        gen, seconds = timed(run_ours)
        ours_times.append(seconds)
        if device.type == "cpu":  # ours again with torch's F.linear, the GEMM transformers runs
            with linears_of_torch():
                same_kernel_gen, seconds = timed(run_ours)
            same_kernel_times.append(seconds)
        with get_platform().plain_tensor_ops():  # a transformers user runs without our device mapping
            (hf_rows, hf_calls, hf_positions), seconds = timed(lambda: hf_generate(hf, prompts.to(device), lengths, eos, w))
        hf_times.append(seconds)
    ours_s, hf_s = median(ours_times), median(hf_times)
    ours_rows = responses(gen, lengths)
    useful = sum(len(r) for r in ours_rows)
    response_lengths = sorted(len(r) for r in ours_rows)
    s = gen.stats
    figures = {
        "workload": {"prompts": w.prompts, "prompt_tokens": f"{w.min_prompt}-{w.max_prompt}", "new_tokens": w.new_tokens,
                     "eos": eos, "response_lengths_min_median_max":
                     [response_lengths[0], response_lengths[len(response_lengths) // 2], response_lengths[-1]],
                     "model": f"h{args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), "
                              f"ffn {args.ffn}, vocab {args.vocab}, {args.precision}", "device": str(device),
                     "slots": w.slots, "hf_batch": w.hf_batch or w.prompts, "repeats": args.repeats,
                     "threads": torch.get_num_threads(), "processor": processor(),
                     "engine_linears": chosen_kernel() if device.type == "cpu" else "torch"},
        "ours_useful_tokens_per_s": useful / ours_s,
        "transformers_useful_tokens_per_s": sum(len(r) for r in hf_rows) / hf_s,
        "ratio": (useful / ours_s) / (sum(len(r) for r in hf_rows) / hf_s),
        "positions_computed_ratio": hf_positions / (s.computed_tokens + s.bucket_rows),
        "ours_seconds": ours_s, "transformers_seconds": hf_s,
        "ours_positions_computed": s.computed_tokens + s.bucket_rows, "transformers_positions_computed": hf_positions,
        "ours_forward_passes_per_useful_token": s.forward_passes / useful,
        "transformers_forward_passes_per_useful_token": hf_calls / useful,
        "decode_occupancy_of_rows_computed": s.useful / s.sampled,
        "decode_occupancy_of_all_slots": s.useful / s.slot_steps,
        "computed_tokens_per_useful_token": (s.computed_tokens + s.bucket_rows) / useful,
        "greedy_rows_identical": f"{sum(a == b for a, b in zip(ours_rows, hf_rows))}/{w.prompts}",
        **pass_padding(gen, w),
    }
    figures.update(step_against_memory_floor(ours, gen, ours_s, decode_step_seconds(run_ours), args))
    figures.update(decode_step_memory(arch, gen, w))
    if invariant is not None:
        figures.update(invariant_cost(ours, invariant, prompts, lengths, params, w, args))
    if same_kernel_times:
        same_kernel_rows = responses(same_kernel_gen, lengths)
        figures["ratio_with_torch_linears"] = (useful / median(same_kernel_times)) / (sum(len(r) for r in hf_rows) / hf_s)
        figures["torch_linears_greedy_rows_identical"] = f"{sum(a == b for a, b in zip(same_kernel_rows, hf_rows))}/{w.prompts}"
    return figures


def invariant_cost(ours, invariant, prompts, lengths, params, w, args) -> dict:
    """Ours plain and in batch-invariant mode on workload ``w``'s prompts, alternating run by run:
    useful tokens/s of each (medians) and their ratio, and whether the greedy rows agree. The mode's
    rows are the workload's longest (a run's sequence length: max prompt + new tokens)."""
    plain_times, invariant_times = [], []
    for _ in range(args.repeats):
        plain, seconds = timed(lambda: generate(ours, prompts, lengths, params, args.vocab, batch_size=w.slots))
        plain_times.append(seconds)
        with batch_invariant(w.max_prompt + w.new_tokens):
            rows, seconds = timed(lambda: generate(invariant, prompts, lengths, params, args.vocab, batch_size=w.slots))
        invariant_times.append(seconds)
    plain_rate = int(plain.response_lengths.sum()) / median(plain_times)
    invariant_rate = int(rows.response_lengths.sum()) / median(invariant_times)
    same = sum(a == b for a, b in zip(responses(plain, lengths), responses(rows, lengths)))
    return {"plain_useful_tokens_per_s": plain_rate, "batch_invariant_useful_tokens_per_s": invariant_rate,
            "batch_invariant_over_plain": invariant_rate / plain_rate,
            "batch_invariant_greedy_rows_identical_to_plain": f"{same}/{w.prompts}"}


def copy_bandwidth(device, nbytes: int = 512 * 2**20) -> float:
    """Bytes per second the device moves in a copy (read + write), the best of five."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _, seconds = timed(lambda: dst.copy_(src))
        best = min(best, seconds)
    return 2 * nbytes / best


def decode_step_seconds(run) -> float:
    """The mean time of a decode step alone, in one more run of ours: on CUDA the device's time
    between events recorded on the stream around each step (nothing synchronises inside the run),
    on CPU the wall time of each step."""
    spans, plain = [], EngineStep._run_decode
    on_cuda = get_platform().device.type == "cuda"

    def timed_decode(self, step):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            rows = plain(self, step)
            end.record()
            spans.append(lambda: start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            rows = plain(self, step)
            spans.append(lambda seconds=time.perf_counter() - started: seconds)
        return rows

    with mock.patch.object(EngineStep, "_run_decode", timed_decode):
        timed(run)
    return sum(span() for span in spans) / len(spans)


def step_against_memory_floor(model, gen, seconds: float, decode_seconds: float, args) -> dict:
    """The engine's mean step time (every pass, prefill too) and its decode step alone against the
    least time a decode step can take: the weights and the KV cache it reads (every row's positions
    so far, at the mean response's midpoint), over the device's copy bandwidth."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    per_position = 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * (2 if args.precision == "bf16" else 4)
    mean_extent = float((gen.prompt_lengths + gen.response_lengths / 2).float().mean())
    rows = gen.stats.slot_steps / max(gen.stats.forward_passes, 1)  # slots per step
    floor = (params + rows * mean_extent * per_position) / copy_bandwidth(get_platform().device)
    step = seconds / gen.stats.forward_passes
    return {"ours_step_ms": 1e3 * step, "memory_floor_ms": 1e3 * floor, "step_over_memory_floor": step / floor,
            "decode_step_ms": 1e3 * decode_seconds, "decode_step_over_memory_floor": decode_seconds / floor}


def decode_step_memory(arch, gen, w) -> dict:
    """The planner's decode step (memory/planner.decode_step_bytes: what the graphs' pool holds)
    beside what the pool reserved (CUDA; 0 elsewhere, where nothing is captured)."""
    planned = decode_step_bytes(arch, min(w.slots, w.prompts) + 1, w.max_prompt + w.new_tokens, 1, 1, w.precision)
    return {"decode_step_planned_mib": planned / 2**20, "graph_pool_mib": gen.stats.graph_pool_bytes / 2**20}


def responses(gen, lengths):
    return [gen.tokens[r, int(lengths[r]) : int(gen.total_lengths[r])].tolist() for r in range(len(lengths))]


def linears_of_torch():
    """Our engine with torch's own linear kernel (runtime/cpu_linears.py): the like-for-like GEMM."""
    return mock.patch.dict(os.environ, {KERNEL_VARIABLE: "torch"})


def main():
    args = parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    init_distributed(ParallelConfig(1, 1), seed=args.seed)
    device = get_platform().device
    chosen = workloads(args)
    longest = max(w.max_prompt + w.new_tokens for _, w in chosen)
    hf, ours, arch = converted_llama(args, longest)
    invariant = None
    if args.batch_invariant:  # the same weights in a model built in the mode (its linears in row blocks)
        with batch_invariant(longest):
            invariant = build_model(arch, ParallelConfig(1, 1), "lm", precision=args.precision)
        load_local_state_dict(invariant, local_state_dict(ours))
    hf = hf.to(device=device, dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32)
    warm = torch.randint(3, args.vocab, (2, 8))
    generate(ours, warm, torch.tensor([8, 5]), SamplingParams(4, greedy=True, pad_id=PAD), args.vocab)
    hf.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=PAD)

    results = {}
    for name, w in chosen:
        results[name] = compare(ours, arch, hf, w, args, invariant)
        print(f"== {name}")
        for key, value in results[name].items():
            print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if len(results) > 1:
        same = "ratio_with_torch_linears" in next(iter(results.values()))
        print("\n| workload | ours tokens/s | transformers tokens/s | ratio | positions-computed ratio (bound) | greedy rows identical |"
              + (" ratio with torch's linears | its greedy rows identical |" if same else ""))
        print("|---|---|---|---|---|---|" + ("---|---|" if same else ""))
        for name, r in results.items():
            print(f"| {name} | {r['ours_useful_tokens_per_s']:.0f} | {r['transformers_useful_tokens_per_s']:.0f} | "
                  f"{r['ratio']:.2f}x | {r['positions_computed_ratio']:.2f}x | {r['greedy_rows_identical']} |"
                  + (f" {r['ratio_with_torch_linears']:.2f}x | {r['torch_linears_greedy_rows_identical']} |" if same else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if args.workload else results["custom"], f, indent=1)
    destroy_distributed()


if __name__ == "__main__":
    main()
