"""The log-prob pass from whole logits against the same pass a chunk of tokens at a time
(``logprob_chunk_tokens``), side by side: peak memory and seconds of an inference pass (log-probs)
and a training pass (GRPO's policy loss, log-probs and entropy, forward and backward), with the
planner's estimate of each pass's activations.

A small-hidden model with Qwen's 151,936-entry vocabulary, one row of ``--tokens`` tokens, fp32,
single process, TP=1. Each pass runs in a fresh process: its peak is the process's high-water mark
of resident memory during the pass above what it held before (the model and the batch). A whole
pass holds the fp32 [tokens, vocabulary] logits and their softmax (5.8 GiB at 4,096 tokens).

    python bench/chunked_log_probs.py                       # 4,096 tokens, chunks of 1,024
    python bench/chunked_log_probs.py --tokens 2048 --chunk 512
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

VOCAB = 151936  # Qwen2.5 / Qwen3
ARCH = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
            vocab_size=VOCAB, max_position_embeddings=65536)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(kind: str, tokens: int, chunk: int, repeats: int) -> dict:
    import torch

    from megatron_rlhf.config.schema import ModelArchConfig, ParallelConfig, PPOConfig
    from megatron_rlhf.memory.planner import activation_bytes
    from megatron_rlhf.models.decoder import build_model
    from megatron_rlhf.models.pipeline import forward_backward
    from megatron_rlhf.models.vocab_parallel import next_token_log_probs, reads_chunked
    from megatron_rlhf.roles.losses import policy_loss_fn
    from megatron_rlhf.runtime import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29517"))
    parallel = ParallelConfig(1, 1)
    init_distributed(parallel, seed=3)
    arch = ModelArchConfig(**ARCH)
    model = build_model(arch, parallel, "lm", precision="fp32", logprob_chunk_tokens=chunk)
    data = torch.Generator().manual_seed(1)
    mb = {"tokens": torch.randint(0, VOCAB, (1, tokens), generator=data),
          "action_mask": torch.ones(1, tokens - 1), "old_log_probs": -torch.rand(1, tokens - 1, generator=data) * 10,
          "advantages": torch.randn(1, tokens - 1, generator=data)}

    @reads_chunked
    def reduce(output, batch):
        return next_token_log_probs(output, batch, VOCAB)

    loss_fn = policy_loss_fn(VOCAB, 1.0, PPOConfig())

    def one_pass():
        if kind == "inference":
            with torch.no_grad():
                return forward_backward(model, [mb], reduce=reduce)[0]["output"]
        model.zero_grad(set_to_none=True)
        return forward_backward(model, [mb], loss_fn, forward_only=False)[0]["loss"]

    before = _rss()
    started = time.perf_counter()
    result = one_pass()
    first_s = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    seconds = [first_s]
    for _ in range(repeats - 1):
        started = time.perf_counter()
        one_pass()
        seconds.append(time.perf_counter() - started)
    planned = activation_bytes(arch, "lm", 1, tokens, 1, 1, "fp32", False, kind == "training", VOCAB,
                               logprob_chunk_tokens=chunk)
    return {"peak": peak, "seconds": min(seconds), "planned": planned, "checksum": float(result.double().sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.tokens, int(args.child[1]), args.repeats)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONWARNINGS": "ignore"}
    rows = {}
    for kind in ("inference", "training"):
        for chunk in (0, args.chunk):
            out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
                                  "--child", kind, str(chunk)], env=env, capture_output=True, text=True, check=True)
            rows[kind, chunk] = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 2 ** 30
    print(f"log-prob pass, {args.tokens} tokens, vocabulary {VOCAB}, hidden {ARCH['hidden_size']}, fp32, "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    print(f"{'pass':<10}{'chunk':>7}{'peak GiB':>10}{'planned GiB':>13}{'seconds':>9}")
    for (kind, chunk), r in rows.items():
        print(f"{kind:<10}{chunk or 'whole':>7}{r['peak'] / gib:>10.3f}{r['planned'] / gib:>13.3f}{r['seconds']:>9.3f}")
    for kind in ("inference", "training"):
        whole, chunked = rows[kind, 0], rows[kind, args.chunk]
        print(f"{kind}: chunked peak / whole {chunked['peak'] / whole['peak']:.3f}; chunked speed / whole "
              f"{whole['seconds'] / chunked['seconds']:.2f}x; planned / measured: whole "
              f"{whole['planned'] / whole['peak']:.2f}, chunked {chunked['planned'] / chunked['peak']:.2f}; "
              f"results differ by {abs(whole['checksum'] - chunked['checksum']):.2e}")


if __name__ == "__main__":
    main()
