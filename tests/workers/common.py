"""Shared helpers of the torchrun worker scripts (run by tests/conftest.py:run_workers)."""

import os
import sys

import torch
import torch.distributed as dist

from megatron_rlhf.config.schema import ModelArchConfig, ParallelConfig
from megatron_rlhf.config.presets import PRESETS
from megatron_rlhf.runtime import init_distributed

OUT_DIR = sys.argv[1]
ARGS = sys.argv[2:]


def tiny_arch(**overrides) -> ModelArchConfig:
    return ModelArchConfig(**{**PRESETS["tiny"], **overrides})


def setup(tp: int = 1, pp: int = 1, sp: bool = False, seed: int = 1234) -> ParallelConfig:
    """Start (or switch) megatron's parallel layout within the same torch.distributed world."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel = ParallelConfig(tp, pp, sp)
    init_distributed(parallel, seed=seed)
    return parallel


def rank() -> int:
    return dist.get_rank()


def save(result: dict) -> None:
    torch.save(result, os.path.join(OUT_DIR, f"rank{rank()}.pt"))
    dist.barrier()
