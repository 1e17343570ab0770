"""Build every role of a config on this rank, run each inference role forward and each trainable
role a few optimizer steps, and print what happened. A quick check that a config, a parallel layout
and a machine work together, before a long PPO run.

    torchrun --nproc_per_node=2 -m megatron_rlhf.smoke --config examples/tiny/rlhf.yaml
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist

from megatron_rlhf.config import load_config
from megatron_rlhf.models.training import next_token_loss, scalar_regression_loss
from megatron_rlhf.runtime import destroy_distributed, init_distributed
from megatron_rlhf.runtime.host_groups import host_sum


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="top config file (rlhf.yaml)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per trainable role")
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--output-dir", default="outputs/smoke", help="where memory.jsonl goes")
    args = parser.parse_args(argv)
    # megatron-core and torch warn about fallbacks and deprecations in their own internals;
    # MEGATRON_RLHF_WARNINGS=1 shows them.
    if not os.environ.get("MEGATRON_RLHF_WARNINGS"):
        warnings.simplefilter("ignore", (UserWarning, FutureWarning))

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = load_config(args.config, world_size=world_size)  # every config error before any work
    par = config.parallel
    init_distributed(par, seed=config.seed)
    from megatron.core import parallel_state as ps

    from megatron_rlhf.memory import MemoryLedger
    from megatron_rlhf.roles import build_role

    rank0 = dist.get_rank() == 0
    last_stage_tp0 = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if rank0:
        print(f"world {world_size}: TP={par.tensor_model_parallel_size} PP={par.pipeline_model_parallel_size} DP={dp}")
    gen = torch.Generator().manual_seed(config.seed)
    ledger_path = os.path.join(args.output_dir, "memory.jsonl")
    if rank0 and os.path.exists(ledger_path):
        os.remove(ledger_path)  # this run's ledger, not appended to an earlier one
    ledger = MemoryLedger(ledger_path if rank0 else None, guard=config.trainer.memory_guard)
    roles = {}
    for name in config.model_roles:
        start = time.perf_counter()
        role = roles[name] = build_role(name, config)
        ledger.track(role.memory)
        params = sum(p.numel() for p in role.model.parameters())
        total = host_sum([params])  # every rank's shard, DP replicas counted once below
        rc = role.config
        rows = rc.micro_batch_size if rc.token_budget is None else max(1, rc.token_budget // args.seq_length)
        tokens = torch.randint(0, rc.model.vocab_size, (rows * 2 * dp, args.seq_length), generator=gen)
        mine = tokens.chunk(dp)[dp_rank]
        mbs = [{"tokens": t} for t in mine.split(rows)]
        if role.trainable:
            losses = []
            for _ in range(args.steps):
                with role.resident("training"):
                    step = role.train_step(mbs, next_token_loss if role.head == "lm" else scalar_regression_loss)
                if step["metrics"]:
                    losses.append(torch.stack([m["loss"] for m in step["metrics"]]).mean().item())
            what = "loss " + " -> ".join(f"{x:.4f}" for x in losses)
        else:
            with role.resident("inference"):
                outputs = role.forward(mbs)
            what = f"output {tuple(outputs[0].shape)} per micro-batch (this TP rank's share)" if outputs else ""
        if last_stage_tp0 and dp_rank == 0:
            print(
                f"[{name:>10}] {rc.precision} {role.head:>6} head, {int(total.item()) // dp:,} params "
                f"in all shards, {time.perf_counter() - start:.1f}s: {what}",
                flush=True,
            )
    ledger.record("phase_end", "smoke")
    if rank0:
        full = sum(ledger.role_peak_bytes().values())
        print(
            f"memory (rank 0): peak resident role state {ledger.peak_resident_bytes() / 2**20:.2f} MiB at any "
            f"moment; the six roles together {full / 2**20:.2f} MiB; "
            f"{len(ledger.records)} ledger records in {ledger_path}"
        )
    destroy_distributed()


if __name__ == "__main__":
    main()
