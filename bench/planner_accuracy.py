"""The planner's activation and KV-cache estimates against what a run holds, side by side.

KV cache: the bytes of the generation engine's cache for B prompts of S/2 tokens and S/2 new
tokens (S positions per slot), and on CUDA the allocator's peak during that generation above what
was allocated before it. Activations: the distinct storages autograd keeps for backward during one
training forward of a micro-batch (saved-tensor hooks), plus the logits; on CUDA also the
allocator's peak during forward and backward above what was allocated before (which includes the
parameters' gradients and the loss's temporaries), and the step's seconds. Each core attention
asked for (``--attention fused local``: torch's fused kernels against megatron's s x s scores) is
built and measured in turn. Single process, TP=1, PP=1.

    python bench/planner_accuracy.py            # tiny and a 256-hidden, 4-layer model
    python bench/planner_accuracy.py --models kit --batch 1 --seq 4096 --attention fused local --precision bf16
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_rlhf.config.schema import ModelArchConfig, ParallelConfig  # noqa: E402
from megatron_rlhf.generation import SamplingParams, generate  # noqa: E402
from megatron_rlhf.memory.planner import activation_bytes, kv_cache_bytes  # noqa: E402
from megatron_rlhf.models.decoder import build_model  # noqa: E402
from megatron_rlhf.models.training import next_token_loss  # noqa: E402
from megatron_rlhf.runtime import get_platform, init_distributed  # noqa: E402


class AllocatorPeak:
    """On CUDA, the allocator's peak inside the block above what was allocated when it began."""

    def __init__(self):
        self.cuda = get_platform().name == "cuda"
        self.bytes = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self._start


def measured_kv(model, arch, batch, seq):
    """(engine cache bytes, allocator peak of the generation or None)."""
    model.eval()
    device = get_platform().device
    half = seq // 2
    prompts = torch.randint(3, arch.vocab_size, (batch, half), device=device)
    sizes = []

    @contextlib.contextmanager
    def on_cache(cache):
        sizes.append(cache.nbytes)
        yield

    with AllocatorPeak() as peak:
        generate(model, prompts, torch.full((batch,), half), SamplingParams(seq - half, greedy=True),
                 arch.vocab_size, on_cache=on_cache)
    return sizes[0], peak.bytes


def measured_activations(model, arch, batch, seq):
    """(bytes autograd keeps, allocator peak or None, the median seconds of three more steps)."""
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen and ptr not in params:
            seen.add(ptr)
            total[0] += storage.nbytes()
        return t

    device = get_platform().device
    tokens = torch.randint(0, arch.vocab_size, (batch, seq), device=device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    def step():
        loss, _, _ = next_token_loss(model(tokens, positions, None), {"tokens": tokens})
        loss.backward()
        model.zero_grad(set_to_none=True)

    with AllocatorPeak() as peak:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(tokens, positions, None)
            loss, _, _ = next_token_loss(out, {"tokens": tokens})
        loss.backward()
    model.zero_grad(set_to_none=True)
    del out, loss
    seconds = []
    for _ in range(3):
        get_platform().synchronize()
        started = time.perf_counter()
        step()
        get_platform().synchronize()
        seconds.append(time.perf_counter() - started)
    return total[0], peak.bytes, statistics.median(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--attention", nargs="+", default=["fused"], choices=["fused", "local"])
    parser.add_argument("--models", nargs="+", default=["tiny", "h256"], choices=["tiny", "h256", "kit"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_distributed(ParallelConfig(1, 1), seed=0)
    models = {
        "tiny (h64, 2 layers)": ModelArchConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                               ffn_hidden_size=128, vocab_size=128, max_position_embeddings=256),
        "h256, 4 layers": ModelArchConfig(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=8,
                                          ffn_hidden_size=688, vocab_size=1000, max_position_embeddings=512),
        # the GPU kit's generation model (bench/gpu/run.sh)
        "kit (h1024, 8 layers)": ModelArchConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                                                 ffn_hidden_size=2816, vocab_size=32000, max_position_embeddings=8192),
    }
    models = {name: arch for name, arch in models.items() if name.split()[0].rstrip(",") in args.models}
    print(f"device {get_platform().name}; batch {args.batch}, sequence {args.seq}, {args.precision}, TP=1 PP=1")
    print(f"{'model':<22}{'what':<22}{'planned':>15}{'measured':>15}{'planned/measured':>18}{'allocator peak':>16}"
          f"{'step s':>9}")
    rows = []
    for name, arch in models.items():
        for attention in args.attention:
            model = build_model(arch, ParallelConfig(1, 1), "lm", precision=args.precision, attention=attention)
            measured = [("activations, " + attention, activation_bytes(
                arch, "lm", args.batch, args.seq, 1, 1, args.precision, False, True, attention=attention),
                measured_activations(model, arch, args.batch, args.seq))]
            if attention == args.attention[0]:  # the engine's cache does not depend on the training attention
                measured.insert(0, ("kv cache", kv_cache_bytes(arch, args.batch, args.seq, 1, 1, args.precision),
                                    (*measured_kv(model, arch, args.batch, args.seq), None)))
            for what, planned, (bytes_kept, peak, seconds) in measured:
                rows.append({"model": name, "what": what, "planned": planned, "measured": bytes_kept,
                             "allocator_peak": peak, "step_s": seconds})
                print(f"{name:<22}{what:<22}{planned:>15,}{bytes_kept:>15,}{planned / bytes_kept:>18.3f}"
                      f"{'-' if peak is None else format(peak, ','):>16}{'-' if seconds is None else format(seconds, '.3f'):>9}")
            del model
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
