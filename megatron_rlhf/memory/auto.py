"""``free_memory: auto``: at start-up, before any model is built, the fewest EMS switches of the
roles set to auto that make the planner's peak fit the device memory free on every rank. The
choice is the planner's own recommendation (``recommend``, the same as `python -m
megatron_rlhf.plan --gpu-memory`), printed with its reason and written to the output directory.

``generation.batch_size: auto``: then, with the switches as chosen, the most rows decoded at once
(the KV cache's slots) whose plan still fits that memory (``decode_slots``), printed and written
likewise."""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

from megatron_rlhf.config.schema import EMS_SWITCHES, RLHFConfig
from megatron_rlhf.memory.kinds import EMSSwitches
from megatron_rlhf.memory.planner import Plan, plan, recommend, rollout_rows

CHOICE_FILE = "free_memory_auto.json"
SLOTS_FILE = "generation_batch_size_auto.json"


def auto_roles(config: RLHFConfig) -> Tuple[str, ...]:
    return tuple(r for r in config.model_roles if config.role(r).free_memory == "auto")


def choose_free_memory(config: RLHFConfig, world_size: int, device_memory: int) -> Tuple[Optional[Dict[str, EMSSwitches]], Plan]:
    """The switches of every role (auto roles chosen, the others as configured) and their plan;
    None when even every auto role offloaded does not fit ``device_memory``."""
    return recommend(config, world_size, device_memory, free_roles=auto_roles(config))


def apply_choice(config: RLHFConfig, switches: Dict[str, EMSSwitches]) -> None:
    """Write the chosen switches into the auto roles' configs (a switch set explicitly stays)."""
    for role in auto_roles(config):
        rc = config.role(role)
        for field in EMS_SWITCHES:
            if getattr(rc, field) is None:
                setattr(rc, field, getattr(switches[role], field))


def describe(config: RLHFConfig, world_size: int, device_memory: int, switches, fitted: Plan) -> dict:
    from megatron_rlhf.units import human

    roles = auto_roles(config)
    nothing = plan(config, world_size)  # auto roles with nothing offloaded
    chosen = {r: list(switches[r].kinds()) if switches else None for r in roles}
    moved = "; ".join(f"{r}: {', '.join(k)}" for r, k in chosen.items() if k) or "nothing"
    if switches is None:
        reason = (f"does not fit: with every switch of {', '.join(roles)} on, the peak is {human(fitted.peak_bytes)} "
                  f"({fitted.peak_phase}) against {human(device_memory)} free on the device")
    else:
        reason = (f"{human(device_memory)} free on the device (the least over the ranks); with nothing offloaded the "
                  f"peak would be {human(nothing.peak_bytes)} ({nothing.peak_phase}); offloading {moved} gives "
                  f"{human(fitted.peak_bytes)} ({fitted.peak_phase})")
    return {"roles": list(roles), "device_free_bytes": device_memory, "chosen": chosen,
            "peak_bytes": fitted.peak_bytes, "peak_phase": fitted.peak_phase,
            "peak_bytes_without_offload": nothing.peak_bytes, "reason": reason}


def decode_slots(config: RLHFConfig, world_size: int, device_memory: int) -> Tuple[int, int, Plan]:
    """(slots, rows, plan): the most of a DP rank's ``rows`` of the rollout decoded at once whose
    plan's peak fits ``device_memory`` with every role's switches as configured (0 when not even one
    fits), and the plan at that many (at one, when none fits). The peak grows with the slots: a bisection."""
    rows = rollout_rows(config, "policy", world_size)
    original = config.generation.batch_size

    def planned(slots: int) -> Plan:
        config.generation.batch_size = slots
        return plan(config, world_size)

    try:
        low, high = 0, rows  # the answer lies in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if planned(middle).peak_bytes <= device_memory else (low, middle - 1)
        return low, rows, planned(max(low, 1))
    finally:
        config.generation.batch_size = original


def no_row_fits(fitted: Plan, device_memory: int) -> str:
    """Why not one row can be decoded (``fitted``: the plan at one row), naming what does not fit:
    the generation phase with one row's KV cache, or another phase, which no batch size changes."""
    from megatron_rlhf.units import human

    free, peak, kv = human(device_memory), human(fitted.peak_bytes), human(fitted.transient["policy"]["kv_cache"])
    if fitted.phases["generate"] <= device_memory:
        return (f"the {fitted.peak_phase} phase peaks at {peak} against {free} free whatever the rows decoded at once "
                f"(one row's KV cache is {kv}, and the generation phase fits); free memory there (free_memory, "
                "logprob_chunk_tokens, micro-batches, TP/PP) or shorten the sequences")
    return (f"not one row's KV cache fits: with a single row ({kv} of cache) the generation phase peaks at "
            f"{human(fitted.phases['generate'])} against {free} free; free more memory (free_memory, TP/PP) or "
            "shorten the sequences")


def resolve_decode_slots(config: RLHFConfig, world_size: int, output_dir: str, device_memory: int) -> Optional[dict]:
    """``generation.batch_size: auto`` chosen for ``device_memory`` (device_budget()), set in the
    config, printed and recorded (rank 0). Raises RunError when not one row fits (no_row_fits says why)."""
    from megatron_rlhf.errors import RunError
    from megatron_rlhf.units import human

    if config.generation.batch_size != "auto":
        return None
    slots, rows, fitted = decode_slots(config, world_size, device_memory)
    if slots == 0:
        raise RunError(f"generation.batch_size: auto: {no_row_fits(fitted, device_memory)}", collective=True)
    config.generation.batch_size = slots
    reason = (f"{slots} of {rows} rows decoded at once per DP rank (the KV cache {human(fitted.transient['policy']['kv_cache'])}"
              f", the peak {human(fitted.peak_bytes)} in {fitted.peak_phase}, against {human(device_memory)} free on the "
              "device)")
    record = {"slots": slots, "rows": rows, "device_free_bytes": device_memory, "peak_bytes": fitted.peak_bytes,
              "peak_phase": fitted.peak_phase, "reason": reason}
    _announce("generation.batch_size", record, output_dir, SLOTS_FILE)
    return record


def _announce(key: str, record: dict, output_dir: str, file: str) -> None:
    """Rank 0 prints an auto choice with its reason and writes its record to the output directory."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return
    print(f"{key}: auto: {record['reason']}", flush=True)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, file)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    os.replace(path + ".tmp", path)


def device_budget() -> int:
    """The device memory free now, the least over all ranks (so that every rank decides alike);
    collective, before any model is built."""
    import torch
    import torch.distributed as dist

    from megatron_rlhf.runtime.platform import get_platform

    platform = get_platform()
    free = torch.tensor([platform.device_free_bytes()], dtype=torch.int64, device=platform.device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return int(free.item())


def resolve_free_memory(config: RLHFConfig, world_size: int, output_dir: str, device_memory: int) -> Optional[dict]:
    """Choose the auto roles' switches for ``device_memory`` (device_budget()), apply them, print
    and record the choice (rank 0). Raises RunError when nothing fits."""
    from megatron_rlhf.errors import RunError

    if not auto_roles(config):
        return None
    switches, fitted = choose_free_memory(config, world_size, device_memory)
    record = describe(config, world_size, device_memory, switches, fitted)
    if switches is None:
        raise RunError(f"free_memory: auto: {record['reason']}; raise TP/PP, enable recompute_activations or lower "
                       "micro-batch and sequence sizes", collective=True)
    apply_choice(config, switches)
    _announce("free_memory", record, output_dir, CHOICE_FILE)
    return record
