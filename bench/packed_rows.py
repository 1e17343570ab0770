"""Packed rows against today's padded micro-batches, side by side on one process: a training pass
(GRPO's policy loss with the entropy, forward and backward, every micro-batch of one optimizer
step) over a long-tailed mix of row lengths (``--rows`` rows of 64 to 4,096 tokens, most short),
cut by the same token budget: padded rows sorted longest first, each micro-batch at most
``--budget`` rows x its longest row's tokens; packed rows, each micro-batch at most ``--budget``
real tokens laid end to end. Printed: the positions each computes per real token, the pass's
seconds and real tokens per second (best of ``--repeats``), and the loss and gradient norm of both,
which must agree.

    python bench/packed_rows.py                     # 48 rows, budget 4,096 tokens
    python bench/packed_rows.py --rows 96 --budget 8192
"""

import argparse
import os
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

ARCH = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=688,
            vocab_size=4096, max_position_embeddings=8192)


def long_tailed_lengths(rows: int, seed: int):
    """Row lengths from 64 to 4,096, Pareto-tailed (64 / u^1.25): half under 152 tokens, a few thousands."""
    import torch

    g = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, generator=g).clamp(min=1e-6)
    return (64 * u.pow(-1.25)).round().long().clamp(64, 4096)


def columns_of(lengths, vocab: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    rows, width = lengths.shape[0], int(lengths.max())
    actions = torch.arange(1, width).unsqueeze(0) < lengths.unsqueeze(1)
    return {"tokens": torch.randint(0, vocab, (rows, width), generator=g), "action_mask": actions.float(),
            "old_log_probs": -torch.rand(rows, width - 1, generator=g) * 8,
            "advantages": torch.randn(rows, width - 1, generator=g)}


def measure(packs: bool, lengths, budget: int, repeats: int) -> dict:
    import torch

    from megatron_rlhf.config.schema import ModelArchConfig, ParallelConfig, PPOConfig, RoleConfig
    from megatron_rlhf.models.batches import ROW_LENGTHS, micro_batches_of
    from megatron_rlhf.models.decoder import build_model
    from megatron_rlhf.models.training import train_step, wrap_for_training
    from megatron_rlhf.roles.losses import policy_loss_fn
    from megatron_rlhf.runtime import init_distributed

    parallel = ParallelConfig(1, 1)
    init_distributed(parallel, seed=3)
    arch = ModelArchConfig(**ARCH)
    role = RoleConfig(precision="fp32", lr=0.0, micro_batch_size="auto", max_tokens_per_micro_batch=budget,
                      pack_rows=packs, use_distributed_optimizer=False)
    model = build_model(arch, parallel, "lm", precision="fp32", logprob_chunk_tokens=1024, pack_rows=packs)
    ddp, optimizer = wrap_for_training(model, role)
    mbs, _ = micro_batches_of(role, lengths, **columns_of(lengths, arch.vocab_size, seed=1))
    positions = sum(int(mb[ROW_LENGTHS].sum()) if packs else mb["tokens"].numel() for mb in mbs)
    loss_fn = policy_loss_fn(arch.vocab_size, 1.0, PPOConfig())
    train_step(ddp, optimizer, mbs, loss_fn)  # warm: buffers, kernels (lr 0: the weights stay)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = train_step(ddp, optimizer, mbs, loss_fn)
        best = min(best, time.perf_counter() - start)
    loss = sum(float(m["loss"]) for m in result["metrics"]) / sum(float(m["loss_count"]) for m in result["metrics"])
    return {"micro_batches": len(mbs), "positions": positions, "seconds": best, "loss": loss,
            "grad_norm": float(result["grad_norm"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--budget", type=int, default=4096, help="max_tokens_per_micro_batch of both")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    import torch

    lengths = long_tailed_lengths(args.rows, args.seed)
    real = int(lengths.sum())
    print(f"{args.rows} rows of {int(lengths.min())}-{int(lengths.max())} tokens (median {int(lengths.median())}), "
          f"{real:,} real tokens; token budget {args.budget:,} per micro-batch; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    padded = measure(False, lengths, args.budget, args.repeats)
    packed = measure(True, lengths, args.budget, args.repeats)
    for name, r in (("padded (today)", padded), ("packed", packed)):
        print(f"  {name:15s} {r['micro_batches']:3d} micro-batches, {r['positions'] / real:.3f} positions per real "
              f"token, {r['seconds']:.2f} s, {real / r['seconds']:,.0f} real tokens/s; loss {r['loss']:.8f}, "
              f"grad norm {r['grad_norm']:.8f}")
    print(f"  packed / padded: tokens/s {padded['seconds'] / packed['seconds']:.2f}x, positions "
          f"{packed['positions'] / padded['positions']:.3f}; loss {abs(packed['loss'] - padded['loss']):.1e} apart, "
          f"grad norm {abs(packed['grad_norm'] - padded['grad_norm']) / padded['grad_norm']:.1e} relative")


if __name__ == "__main__":
    main()
