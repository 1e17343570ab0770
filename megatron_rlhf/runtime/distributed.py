"""Distributed start-up from torchrun's environment and megatron's parallel state.

megatron.core.parallel_state holds the run's TP/PP/DP(/EP) groups: the trained roles' layout. Every
role lives on the same ranks (EMS relies on it); a serving role of its own layout runs on groups of
its own over those ranks (runtime/layouts.py).
"""

from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf.config.schema import ParallelConfig
from megatron_rlhf.runtime import megatron_compat
from megatron_rlhf.runtime.host_groups import forget_host_groups, make_host_twins
from megatron_rlhf.runtime.platform import get_platform


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def init_distributed(layout: ParallelConfig, seed: int = 1234, timeout_s: float = 1800.0) -> None:
    """Start torch.distributed from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT; a single process without them), then megatron's parallel state.
    Every collective, in every group, gives up after ``timeout_s`` (a rank that never arrives);
    each group has a host twin for control collectives (runtime/host_groups.py)."""
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    model_parallel = layout.replica_ranks()
    if world_size % model_parallel != 0:  # fail before any collective starts
        raise ValueError(
            f"world size {world_size} is not divisible by TP*PP*CP = {layout.tensor_model_parallel_size}"
            f"*{layout.pipeline_model_parallel_size}*{layout.context_parallel_size} = {model_parallel}"
        )
    if layout.sequence_parallel and layout.tensor_model_parallel_size == 1:
        raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")

    ep = layout.expert_model_parallel_size
    if (world_size // model_parallel) % ep != 0:
        raise ValueError(f"expert_model_parallel_size {ep} does not divide the data-parallel size "
                         f"{world_size // model_parallel}")

    platform = get_platform()
    megatron_compat.import_megatron(platform.compiles_kernels)
    from megatron.core import parallel_state

    megatron_compat.check()
    megatron_compat.bind_router_gemm()
    megatron_compat.bind_rope()
    platform.setup(local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend=platform.dist_backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor_model_parallel_size,
            pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
            expert_model_parallel_size=layout.expert_model_parallel_size,
            context_parallel_size=layout.context_parallel_size,
            distributed_timeout_minutes=timeout_s / 60,  # typed int, used as timedelta(minutes=...)
        )
    make_host_twins([None, parallel_state.get_data_parallel_group(), parallel_state.get_tensor_model_parallel_group(),
                     parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_model_parallel_group(),
                     parallel_state.get_expert_model_parallel_group(), parallel_state.get_context_parallel_group(),
                     parallel_state.get_data_parallel_group(with_context_parallel=True)], timeout_s)
    set_seed(seed)


def set_seed(seed: int) -> None:
    """Seed every generator. The CPU generator gets the same seed on every rank, so megatron's CPU
    weight initialisation builds the same full weights on each TP rank before slicing its shard;
    megatron's tracked states (model-parallel, data-parallel) are seeded per TP rank by megatron."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    from megatron_rlhf.runtime.layouts import forget_layouts

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    forget_layouts()
    forget_host_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def random_state() -> dict:
    """Every generator a run draws from on the host (Python's, NumPy's, torch's CPU one), as plain
    types and tensors: a checkpoint holds it and loads it with ``weights_only``."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}


def restore_random_state(state: dict) -> None:
    """The generators as ``random_state()`` found them."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"],
                         n["cached_gaussian"]))
