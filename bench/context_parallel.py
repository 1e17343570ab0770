"""Context parallelism's cost and memory, side by side: a training pass (GRPO's policy loss with the
entropy, forward and backward) over one row of ``--tokens`` tokens at CP=1 on one process and at CP=2
on two, each rank's peak memory above what it held before the pass, its seconds, and the planner's
estimate of the pass's activations (memory/planner.activation_bytes); the loss and gradient norm of
both, which must agree. Then, with ``--run``, the long-context check through the run's entry:
GRPO on the tiny example with responses of ``--response`` tokens (generation.ignore_eos), 3
iterations at CP=1 on 1 process and CP=2 on 2, every metric compared.

    python bench/context_parallel.py                    # 8,192 tokens, the pass only
    python bench/context_parallel.py --tokens 4096 --run --response 4096
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

ARCH = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=688,
            vocab_size=4096, max_position_embeddings=65536)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark back to the current resident size


def rank_pass(tokens: int, cp: int, out: str) -> None:
    """One rank's pass (run under torchrun); writes its figures to ``out``/rank<r>.json."""
    import torch
    import torch.distributed as dist

    from megatron_rlhf.config.schema import ModelArchConfig, ParallelConfig, PPOConfig, RoleConfig
    from megatron_rlhf.memory.planner import activation_bytes
    from megatron_rlhf.models.decoder import build_model
    from megatron_rlhf.models.training import train_step, wrap_for_training
    from megatron_rlhf.roles.losses import policy_loss_fn
    from megatron_rlhf.runtime import init_distributed

    parallel = ParallelConfig(1, 1, context_parallel_size=cp)
    init_distributed(parallel, seed=3)
    arch = ModelArchConfig(**ARCH)
    model = build_model(arch, parallel, "lm", precision="fp32", logprob_chunk_tokens=1024)
    ddp, optimizer = wrap_for_training(model, RoleConfig(precision="fp32", lr=1e-5, use_distributed_optimizer=False))
    g = torch.Generator().manual_seed(0)
    mb = {"tokens": torch.randint(0, arch.vocab_size, (1, tokens), generator=g),
          "action_mask": torch.ones(1, tokens - 1), "old_log_probs": -torch.rand(1, tokens - 1, generator=g) * 8,
          "advantages": torch.randn(1, tokens - 1, generator=g)}
    loss_fn = policy_loss_fn(arch.vocab_size, 1.0, PPOConfig())
    train_step(ddp, optimizer, [mb], loss_fn)  # warm: buffers, kernels
    dist.barrier()
    _reset_peak()
    before = _rss()
    start = time.perf_counter()
    result = train_step(ddp, optimizer, [mb], loss_fn)
    seconds = time.perf_counter() - start
    peak = _peak_rss() - before
    planned = activation_bytes(arch, "lm", 1, tokens, 1, 1, "fp32", False, True, attention="fused",
                               logprob_chunk_tokens=1024, cp=cp)
    local = torch.tensor([float(sum(float(m["loss"]) for m in result["metrics"])),
                          float(sum(float(m["loss_count"]) for m in result["metrics"]))], dtype=torch.float64)
    dist.all_reduce(local)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"peak": peak, "seconds": seconds, "planned": planned, "loss": (local[0] / local[1]).item(),
                   "grad_norm": float(result["grad_norm"])}, f)


def passes(tokens: int) -> None:
    runs = {}
    for cp in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), f"--nproc-per-node={cp}",
                            "--master-port=29531", __file__, "--rank-pass", str(tokens), str(cp), out],
                           check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
            runs[cp] = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(cp)]
    one, two = runs[1][0], runs[2]
    mib = 1 << 20
    print(f"training pass, one row of {tokens} tokens, h={ARCH['hidden_size']} x {ARCH['num_layers']} layers, "
          f"vocabulary {ARCH['vocab_size']} (log-probs 1,024 tokens at a time), fp32")
    print(f"{'':<8}{'peak MiB/rank':>15}{'planned MiB':>13}{'seconds':>9}{'loss':>14}{'grad norm':>12}")
    print(f"{'CP=1':<8}{one['peak'] / mib:>15.1f}{one['planned'] / mib:>13.1f}{one['seconds']:>9.2f}{one['loss']:>14.8f}"
          f"{one['grad_norm']:>12.6f}")
    for r, rank in enumerate(two):
        print(f"{f'CP=2 r{r}':<8}{rank['peak'] / mib:>15.1f}{rank['planned'] / mib:>13.1f}{rank['seconds']:>9.2f}"
              f"{rank['loss']:>14.8f}{rank['grad_norm']:>12.6f}")
    worst = max(r["peak"] for r in two)
    print(f"per CP rank / CP=1's: {worst / one['peak']:.3f} (1/CP = 0.5); planned / measured: "
          f"CP=1 {one['planned'] / one['peak']:.2f}, CP=2 {two[0]['planned'] / worst:.2f}; "
          f"CP=2 time / CP=1's: {max(r['seconds'] for r in two) / one['seconds']:.2f}; "
          f"loss apart {abs(two[0]['loss'] - one['loss']) / abs(one['loss']):.1e}, "
          f"grad norm apart {abs(two[0]['grad_norm'] - one['grad_norm']) / one['grad_norm']:.1e}")


def run_entry(response: int) -> None:
    """GRPO through megatron_rlhf.train at CP=1 (1 process) and CP=2 (2 processes)."""
    with tempfile.TemporaryDirectory() as base:
        config = os.path.join(base, "grpo.yaml")
        with open(config, "w") as f:
            long_rows = "max_tokens_per_micro_batch: null, micro_batch_size: 1, model: {max_position_embeddings: 8192}"
            f.write(f"includes: {os.path.join(REPO, 'examples/tiny/grpo.yaml')}\n"
                    f"generation: {{max_new_tokens: {response}, ignore_eos: true, samples_per_prompt: 2}}\n"
                    f"ppo: {{rollout_batch_size: 2}}\npolicy: {{{long_rows}}}\nreference: {{{long_rows}}}\n"
                    f"ppo_policy: {{global_batch_size: 4, {long_rows}}}\n")
        rows, seconds = {}, {}
        for cp in (1, 2):
            out = os.path.join(base, f"cp{cp}")
            start = time.perf_counter()
            subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), f"--nproc-per-node={cp}",
                            "--master-port=29533", "-m", "megatron_rlhf.train", "--config", config, "--output-dir", out],
                           check=True, cwd=REPO, capture_output=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1", TP="1", CP=str(cp), ITERATIONS="3"))
            seconds[cp] = time.perf_counter() - start
            rows[cp] = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    keys = [k for k in rows[1][0] if not k.startswith("time/") and isinstance(rows[1][0][k], (int, float))]
    apart = max((abs(b[k] - a[k]) / max(abs(a[k]), 1e-6), abs(b[k] - a[k]), k) for a, b in zip(rows[1], rows[2])
                for k in keys)
    train = {cp: sum(r["time/train_s"] for r in rows[cp]) for cp in rows}
    print(f"\nGRPO through the run's entry, responses of {response} tokens, 3 iterations: CP=1 {seconds[1]:.0f}s, "
          f"CP=2 {seconds[2]:.0f}s (training {train[1]:.1f}s against {train[2]:.1f}s); response/length_mean {[r['response/length_mean'] for r in rows[2]]}; "
          f"reward/mean CP=1 {[round(r['reward/mean'], 4) for r in rows[1]]}, CP=2 {[round(r['reward/mean'], 4) for r in rows[2]]}; "
          f"the metrics at most {apart[0]:.1e} apart relative ({apart[2]}: {apart[1]:.1e} absolute)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-pass":
        rank_pass(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--run", action="store_true", help="also the long-context run through the run's entry")
    parser.add_argument("--response", type=int, default=4096)
    args = parser.parse_args()
    passes(args.tokens)
    if args.run:
        run_entry(args.response)
