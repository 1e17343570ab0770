"""A checkpoint save's optimizer state per rank: every rank writing its own part (the format
checkpoint/optimizer_state.py writes) against megatron's DP-zero gather (the format before it: the
shards gathered onto DP rank 0, which writes them alone), side by side in one launch, at DP = 1, 2
and 4 (TP=1, CPU processes under torchrun).

For each side and DP size it prints the slowest rank's seconds, the most bytes one rank wrote, and
the most host memory one rank's save added (its peak resident set, which only grows: the per-rank
side runs first). The goals (issue 53): per-rank bytes 1/DP of DP=1's, and save time not growing
with DP.

    python bench/checkpoint_save.py                         # hidden 512, 8 layers (about 30M parameters)
    python bench/checkpoint_save.py --hidden 1024 --layers 8 --dp 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(hidden: int, layers: int, out: str) -> None:
    """One rank: build ppo_policy, take a step (so Adam has state), save both ways."""
    import torch.distributed as dist

    from megatron_rlhf.checkpoint.optimizer_state import owned_state_file
    from megatron_rlhf.checkpoint.run_checkpoint import write_files
    from megatron_rlhf.checkpoint.run_checkpoint import _layout
    from megatron_rlhf.config import load_config
    from megatron_rlhf.roles.base import build_role
    from megatron_rlhf.runtime import init_distributed

    world = int(os.environ["WORLD_SIZE"])
    os.environ["TP"] = "1"
    config = load_config(os.path.join(REPO, "examples", "tiny", "rlhf.yaml"), world_size=world)
    arch = config.ppo_policy.model
    arch.hidden_size, arch.num_layers, arch.ffn_hidden_size = hidden, layers, 4 * hidden
    arch.num_attention_heads = arch.num_query_groups = max(4, hidden // 64)
    config.ppo_policy.free_memory = False
    init_distributed(config.parallel, seed=1)
    role = build_role("ppo_policy", config)
    role.model.zero_grad_buffer()
    for param in role.model.parameters():
        param.main_grad.fill_(1e-3)
    role.optimizer.step()
    layout, results = _layout(), {}
    for side in ("per rank", "gather"):
        directory = os.path.join(out, side.replace(" ", "_"))
        dist.barrier()
        before, started = _peak_bytes(), time.perf_counter()
        if side == "per rank":
            path, state = owned_state_file(role.optimizer, role.model, directory, layout)
            write_files([(path, state)])
        else:
            path = os.path.join(directory, f"dp_zero_{dist.get_rank()}.pt")
            os.makedirs(directory, exist_ok=True)
            role.optimizer.save_parameter_state(path)  # collective; DP rank 0 writes
        seconds = time.perf_counter() - started
        dist.barrier()
        written = os.path.getsize(path) if os.path.exists(path) else 0
        results[side] = {"seconds": seconds, "bytes": written, "host": _peak_bytes() - before}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        summary = {side: {k: max(r[side][k] for r in everyone) for k in ("seconds", "bytes", "host")}
                   for side in results}
        params = sum(p.numel() for p in role.model.parameters())
        print("RESULT " + json.dumps({"dp": world, "params": params, **summary}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.hidden, args.layers, args.out)
    rows = []
    for dp in args.dp:
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={dp}", __file__, "--worker",
                       "--hidden", str(args.hidden), "--layers", str(args.layers), "--out", out]
            proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"error: the DP={dp} launch failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(line[len("RESULT "):]))
    print(f"# {rows[0]['params'] / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers), fp32, TP=1, "
          f"{os.cpu_count()} CPUs")
    print(f"{'DP':>3} {'side':<9} {'seconds':>8} {'MiB per rank (max)':>19} {'host MiB per rank (max)':>24}")
    base = {side: rows[0][side]["bytes"] for side in ("per rank", "gather")}
    for row in rows:
        for side in ("per rank", "gather"):
            r = row[side]
            share = r["bytes"] / base[side] if base[side] else 0.0
            print(f"{row['dp']:>3} {side:<9} {r['seconds']:>8.3f} {r['bytes'] / 2**20:>12.1f} ({share:.2f}x) "
                  f"{r['host'] / 2**20:>24.1f}")


if __name__ == "__main__":
    main()
