"""The optimizer's state: the shards and master copies EMS moves, Adam's moments, the DP-zero
checkpoint of the distributed optimizer, the grad norm of an unclipped step."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megatron_rlhf.runtime.megatron_compat.sites import Site

# What each function here relies on (name -> sites), checked at start-up (megatron_compat.check).
ANCHORS: Dict[str, Tuple[Site, ...]] = {
    "optimizer_shards": (
        Site("optimizer/optimizer.py", "self.chained_optimizers"),
        Site("optimizer/optimizer.py", "self.fp32_from_float16_groups"),
        Site("optimizer/distrib_optimizer.py", "self.shard_fp32_from_float16_groups"),
    ),
    "grad_norm": (
        Site("optimizer/optimizer.py", "def get_grad_norm("),
        Site("optimizer/optimizer.py", "if self.config.clip_grad > 0.0:"),
    ),
    "dp_zero_optimizer_checkpoint": (
        Site("optimizer/distrib_optimizer.py", "def save_parameter_state("),
        Site("optimizer/distrib_optimizer.py", "def load_parameter_state_from_dp_zero("),
        Site("optimizer/distrib_optimizer.py", "if self.data_parallel_group.rank() == 0:\n            state_dict = torch.load(filename)"),
        Site("optimizer/optimizer.py", "state_dict = states[idx] if states else None"),
        Site("optimizer/optimizer.py", "def reload_model_params("),
    ),
}


def inner_optimizers(optimizer) -> List:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def main_param_tensors(inner) -> List[torch.Tensor]:
    """fp32 master copies of low-precision weights (distributed-optimizer shards or full copies)."""
    groups = getattr(inner, "shard_fp32_from_float16_groups", None) or getattr(inner, "fp32_from_float16_groups", None) or []
    return [t for group in groups for t in group]


def adam_state(inner) -> Dict:
    """torch.optim state of one megatron optimizer: parameter -> {exp_avg, exp_avg_sq, step}."""
    return inner.optimizer.state


def save_dp_zero_state(optimizer, path: str) -> None:
    """The distributed optimizer's shards gathered over DP (DP rank 0 writes; collective)."""
    optimizer.save_parameter_state(path)


def load_dp_zero_state(optimizer, path: str) -> None:
    """The inverse of save_dp_zero_state, as megatron's load_parameter_state (one state dict for a
    single optimizer, a list for a chain; read on DP rank 0 and scattered), but read to the CPU
    whatever device wrote it (megatron's own loader has no map_location)."""
    inners = inner_optimizers(optimizer)
    states = None
    for index, inner in enumerate(inners):
        if getattr(inner, "is_stub_optimizer", False) or not hasattr(inner, "load_parameter_state_from_dp_zero"):
            continue
        if inner.data_parallel_group.rank() == 0 and states is None:
            states = torch.load(path, map_location="cpu", weights_only=False)
        state = None if states is None else (states if len(inners) == 1 else states[index])
        inner.load_parameter_state_from_dp_zero(state)


def unclipped_grad_norm(optimizer) -> float:
    """The global grad norm of the step just taken, for an optimizer that did not clip (megatron
    computes it only when clip_grad > 0); the main grads are still in place after the step."""
    return float(optimizer.get_grad_norm())


def reload_main_params(optimizer) -> None:
    """Copy freshly loaded model weights into the optimizer's fp32 main params."""
    optimizer.reload_model_params()
