"""EMS benchmark: for one model size, the offload and onload time of each kind of state and its GB/s
next to the machine's copy limit (memcpy bandwidth on CPU; page-locked host <-> device bandwidth on
CUDA), the memory before and after, the EMS share of a training step (its time with a full onload
and offload around it against without), and the peak memory of all six roles colocated with EMS on
and off. Everything is measured side by side in one run.

    python bench/ems.py --preset tiny
    python bench/ems.py --hidden 1024 --layers 8 --heads 16 --groups 4 --ffn 2816 --vocab 32000
    torchrun --nproc_per_node=8 bench/ems.py --preset llama2-7b --tp 8      # on GPUs

Memory figures are the allocator's on CUDA (allocated / reserved) and the process RSS on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_rlhf.config.schema import ROLE_HEADS, PPO_ROLES, ModelArchConfig, ParallelConfig, RoleConfig  # noqa: E402
from megatron_rlhf.memory import OFFLOAD_ORDER, WEIGHTS, MemoryLedger  # noqa: E402
from megatron_rlhf.models.decoder import build_model  # noqa: E402
from megatron_rlhf.config.presets import PRESETS  # noqa: E402
from megatron_rlhf.models.training import next_token_loss, scalar_regression_loss, wrap_for_training  # noqa: E402
from megatron_rlhf.roles.base import assemble_role  # noqa: E402
from megatron_rlhf.runtime import destroy_distributed, get_platform, init_distributed  # noqa: E402

MiB = 2**20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="architecture preset")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--groups", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed training steps each way")
    p.add_argument("--repeats", type=int, default=3, help="timed round trips per kind")
    p.add_argument("--no-six-roles", action="store_true", help="skip the six-role colocation")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args()
    fields = dict(PRESETS[args.preset]) if args.preset else {}
    for flag, key in (("hidden", "hidden_size"), ("layers", "num_layers"), ("heads", "num_attention_heads"),
                      ("groups", "num_query_groups"), ("ffn", "ffn_hidden_size"), ("vocab", "vocab_size")):
        if getattr(args, flag) is not None:
            fields[key] = getattr(args, flag)
    missing = [k for k in ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size", "vocab_size")
               if k not in fields]
    if missing:
        p.error(f"give --preset or every one of --hidden --layers --heads --ffn --vocab (missing {missing})")
    fields.setdefault("max_position_embeddings", max(args.seq_length, 256))
    return args, ModelArchConfig(**fields)


def memory_figure(platform) -> int:
    stats = platform.memory_stats()
    return stats.get("allocated", stats.get("rss", 0))


def make_role(name, arch, parallel, args, free_memory):
    rc = RoleConfig(precision=args.precision, lr=1e-5, free_memory=free_memory,
                    micro_batch_size=args.micro_batch_size)
    model = build_model(arch, parallel, ROLE_HEADS[name], precision=args.precision)
    optimizer = None
    if name in ("ppo_policy", "ppo_value"):
        model, optimizer = wrap_for_training(model, rc)
    return assemble_role(name, rc, model, optimizer)


def batch(arch, args, device):
    tokens = torch.randint(0, arch.vocab_size, (args.micro_batch_size, args.seq_length), device=device)
    return [{"tokens": tokens}]


def copy_limit(platform, nbytes: int, repeats: int = 5) -> dict:
    """The machine's bandwidth for copies of ``nbytes`` in GB/s: device -> host and host -> device
    with EMS's own host arenas (on CPU both are memcpy within RAM)."""
    device = torch.empty(nbytes, dtype=torch.uint8, device=platform.device)
    host = platform.host_arena(nbytes)
    rates = {}
    for name, dst, src in (("to_host", host, device), ("to_device", device, host)):
        times = []
        for _ in range(repeats):
            platform.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            platform.synchronize()
            times.append(time.perf_counter() - t0)
        rates[name] = nbytes / statistics.median(times) / 1e9
    platform.release_host_arena(host)
    return rates


def per_kind_round_trips(role, args, platform):
    """Offload then onload each kind alone, ``repeats`` times; median seconds and memory."""
    rows = []
    memory = role.memory
    for kind in OFFLOAD_ORDER:
        size = memory.resident_bytes()[kind]
        off_times, on_times = [], []
        for _ in range(args.repeats):
            platform.synchronize()
            platform.empty_cache()
            before = memory_figure(platform)
            t0 = time.perf_counter()
            memory.offload([kind])
            platform.synchronize()
            t1 = time.perf_counter()
            platform.empty_cache()
            after = memory_figure(platform)
            t2 = time.perf_counter()
            memory.onload([kind])  # not read-only: the next offload copies again
            t3 = time.perf_counter()
            off_times.append(t1 - t0)
            on_times.append(t3 - t2)
        rows.append({
            "kind": kind, "bytes": size,
            "offload_s": statistics.median(off_times), "onload_s": statistics.median(on_times),
            "memory_before": before, "memory_after_offload": after,
        })
    # Weights that an inference phase only read: the offload frees them without a copy.
    clean = []
    for _ in range(args.repeats):
        memory.offload([WEIGHTS])
        memory.onload([WEIGHTS], read_only=True)
        platform.synchronize()
        t0 = time.perf_counter()
        memory.offload([WEIGHTS])
        platform.synchronize()
        clean.append(time.perf_counter() - t0)
        memory.onload([WEIGHTS])
    rows.append({"kind": "weights (clean)", "bytes": memory.resident_bytes()[WEIGHTS],
                 "offload_s": statistics.median(clean), "onload_s": float("nan"), "copied": 0})
    return rows


def step_times(role, arch, args, platform, ems: bool):
    mbs = batch(arch, args, platform.device)
    times = []
    for i in range(args.steps + 1):
        platform.synchronize()
        t0 = time.perf_counter()
        if ems:
            with role.resident("training"):
                role.train_step(mbs, next_token_loss)
        else:
            role.train_step(mbs, next_token_loss)
        platform.synchronize()
        if i > 0:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def six_role_peak(arch, parallel, args, platform, free_memory: bool):
    """Six roles colocated, two passes over them (forward, or a training step); the first creates
    Adam's state, the second is measured phase by phase: the active role's state as the ledger
    counts it once onloaded, everything resident then (the ledger, every role), and the allocator's
    peak during the phase (CUDA) or the RSS at its end (CPU). A phase's transient is its peak above
    what was allocated once its role was onloaded."""
    ledger = MemoryLedger()
    roles = {}
    for name in PPO_ROLES:
        roles[name] = make_role(name, arch, parallel, args, free_memory)
        ledger.track(roles[name].memory)
        roles[name].memory.offload()
    mbs = batch(arch, args, platform.device)
    phases = []
    for measured in (False, True):
        phases = []
        for name in PPO_ROLES:
            role = roles[name]
            platform.synchronize()
            platform.reset_peak_memory_stats()
            with role.resident("training" if role.trainable else "inference"):
                platform.synchronize()
                onloaded = platform.memory_stats()
                resident = ledger.record("phase_start", name, active_role=name)
                if role.trainable:
                    role.train_step(mbs, next_token_loss if role.head == "lm" else scalar_regression_loss)
                else:
                    role.forward(mbs)
                platform.synchronize()
                end = platform.memory_stats()
            level = onloaded.get("allocated", onloaded.get("rss", 0))
            phases.append({"role": name, "state_bytes": next(r["resident_bytes"] for r in resident if r["role"] == name),
                           "all_resident_bytes": sum(r["resident_bytes"] for r in resident),
                           "onloaded": level, "peak": end.get("peak_allocated", end.get("rss", 0)),
                           "peak_reserved": end.get("peak_reserved", end.get("rss", 0))})
            phases[-1]["transient"] = phases[-1]["peak"] - level
    largest = max(phases, key=lambda p: p["all_resident_bytes"] + p["transient"])
    figures = {
        "phases": phases,
        "peak_resident_state_bytes": max(p["all_resident_bytes"] for p in phases),
        "peak_allocated": max(p["peak"] for p in phases),
        "peak_reserved": max(p["peak_reserved"] for p in phases),
        "largest_phase": largest["role"],
        "largest_phase_state_plus_transient": largest["all_resident_bytes"] + largest["transient"],
    }
    del roles, role, ledger
    gc.collect()
    platform.empty_cache()
    return figures


def say_six_roles(say, label, run):
    say(f"  {label}: {'phase':<11}{'role state':>12}{'all resident':>14}{'onloaded':>11}{'peak':>11}{'transient':>11}  (MiB)")
    for p in run["phases"]:
        say(f"  {'':<{len(label) + 1}} {p['role']:<11}{p['state_bytes'] / MiB:>12.1f}{p['all_resident_bytes'] / MiB:>14.1f}"
            f"{p['onloaded'] / MiB:>11.1f}{p['peak'] / MiB:>11.1f}{p['transient'] / MiB:>11.1f}")


def main():
    warnings.filterwarnings("ignore")
    args, arch = parse_args()
    parallel = ParallelConfig(args.tp, args.pp)
    init_distributed(parallel, seed=1)
    platform = get_platform()
    rank0 = torch.distributed.get_rank() == 0
    say = print if rank0 else (lambda *a, **k: None)

    say(f"device: {platform.name}; model: {dataclasses.asdict(arch)}; TP={args.tp} PP={args.pp} "
        f"{args.precision}, seq {args.seq_length}, micro-batch {args.micro_batch_size}")
    role = make_role("ppo_policy", arch, parallel, args, free_memory=True)
    mbs = batch(arch, args, platform.device)
    with role.resident("training"):
        role.train_step(mbs, next_token_loss)  # creates Adam's state
    role.memory.onload()
    figures = {"round_trips": per_kind_round_trips(role, args, platform)}
    largest = max(r["bytes"] for r in figures["round_trips"])
    figures["copy_limit_gb_s"] = limit = copy_limit(platform, largest)
    say(f"\ncopy limit ({'pinned host <-> device' if platform.name == 'cuda' else 'memcpy in RAM'}, "
        f"{largest / MiB:.1f} MiB): {limit['to_host']:.2f} GB/s to the host, {limit['to_device']:.2f} GB/s back")
    say(f"{'kind':<16}{'MiB':>10}{'offload ms':>12}{'onload ms':>12}{'GB/s off':>10}{'of limit':>10}"
        f"{'GB/s on':>9}{'of limit':>10}{'mem before MiB':>16}{'after MiB':>11}")
    for r in figures["round_trips"]:
        off = r["bytes"] / r["offload_s"] / 1e9 if r["offload_s"] > 0 else float("nan")
        on = r["bytes"] / r["onload_s"] / 1e9 if r["onload_s"] > 0 else float("nan")
        r.update(offload_gb_s=off, onload_gb_s=on)
        if "copied" in r:  # freed without a copy: its time is the resize alone
            say(f"{r['kind']:<16}{r['bytes'] / MiB:>10.1f}{r['offload_s'] * 1e3:>12.2f}{'-':>12}{'no copy':>10}")
            continue
        if r["kind"] == "grads":  # freed, and rebuilt zeroed: nothing is copied either way
            say(f"{r['kind']:<16}{r['bytes'] / MiB:>10.1f}{r['offload_s'] * 1e3:>12.2f}{r['onload_s'] * 1e3:>12.2f}"
                f"{'freed':>10}{'':>10}{'zeroed':>9}{'':>10}{r['memory_before'] / MiB:>16.1f}{r['memory_after_offload'] / MiB:>11.1f}")
            continue
        say(f"{r['kind']:<16}{r['bytes'] / MiB:>10.1f}{r['offload_s'] * 1e3:>12.2f}{r['onload_s'] * 1e3:>12.2f}"
            f"{off:>10.2f}{off / limit['to_host']:>10.2f}{on:>9.2f}{on / limit['to_device']:>10.2f}"
            f"{r['memory_before'] / MiB:>16.1f}{r['memory_after_offload'] / MiB:>11.1f}")

    plain = step_times(role, arch, args, platform, ems=False)
    with_ems = step_times(role, arch, args, platform, ems=True)
    share = (with_ems - plain) / with_ems
    figures["step_s"] = {"without_ems": plain, "with_ems": with_ems, "ratio": with_ems / plain, "ems_share": share}
    say(f"\ntraining step: {plain * 1e3:.1f} ms without EMS, {with_ems * 1e3:.1f} ms with a full "
        f"onload/offload around it: ratio {with_ems / plain:.2f}, EMS {share:.0%} of the step")
    del role

    if not args.no_six_roles:
        # EMS on first: megatron's DDP keeps its gradient hooks in autograd nodes, where Python's
        # collector cannot see the cycle back to the model, so no role is ever freed; EMS on leaves
        # its roles offloaded (nothing on the device), EMS off would leave all of them resident.
        on = six_role_peak(arch, parallel, args, platform, free_memory=True)
        off = six_role_peak(arch, parallel, args, platform, free_memory=False)
        figures["six_roles"] = {"ems_off": off, "ems_on": on}
        label = "allocated/reserved" if platform.name == "cuda" else "RSS"
        say(f"\nsix roles colocated (second pass; the first made Adam's state): peak resident role state "
            f"{off['peak_resident_state_bytes'] / MiB:.1f} MiB with EMS off, {on['peak_resident_state_bytes'] / MiB:.1f} "
            f"MiB on (ratio {on['peak_resident_state_bytes'] / off['peak_resident_state_bytes']:.2f}); peak {label} "
            f"{off['peak_allocated'] / MiB:.1f}/{off['peak_reserved'] / MiB:.1f} MiB off, "
            f"{on['peak_allocated'] / MiB:.1f}/{on['peak_reserved'] / MiB:.1f} MiB on; EMS on, the largest phase "
            f"({on['largest_phase']}) is its state plus transient: {on['largest_phase_state_plus_transient'] / MiB:.1f} MiB")
        say_six_roles(say, "EMS on", on)
        say_six_roles(say, "EMS off", off)
        if platform.name == "cpu":
            say("  (on CPU the host copies live in the same RAM and RSS never falls back across the "
                "two runs, so RSS is no measure of colocation here: read the resident role state)")
    if args.json and rank0:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    destroy_distributed()


if __name__ == "__main__":
    main()
