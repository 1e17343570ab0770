"""The optimizer's state: the shards and master copies EMS moves, Adam's moments, each DP rank's
owned part of the distributed optimizer's state (checkpoints), the grad norm of an unclipped step."""

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
    "owned_optimizer_state": (
        Site("optimizer/distrib_optimizer.py", "def _get_model_param_range_map(self, param: torch.nn.Parameter):"),
        Site("optimizer/distrib_optimizer.py", "def _get_main_param_and_optimizer_states(self, model_param):"),
        Site("optimizer/distrib_optimizer.py", "self.model_param_gbuf_map"),
        Site("optimizer/optimizer.py", "def reload_model_params("),
    ),
    # checkpoint/optimizer_state.py:common_state_for matches groups by these, but where experts live.
    "param_groups": (
        Site("optimizer/optimizer.py", "param_group_identifier_keys = ('wd_mult', 'lr_mult', 'is_expert_parallel', 'is_decoupled_lr')"),
        Site("tensor_parallel/layers.py", "self.expert_parallel = config.expert_model_parallel_size > 1"),
    ),
}


def inner_optimizers(optimizer) -> List:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def param_groups(inner) -> List[dict]:
    """The torch.optim parameter groups of one megatron optimizer (none for the stub a pipeline
    stage without such parameters has)."""
    return list(getattr(getattr(inner, "optimizer", None), "param_groups", None) or [])


def main_param_tensors(inner) -> List[torch.Tensor]:
    """fp32 master copies of low-precision weights (distributed-optimizer shards or full copies)."""
    groups = getattr(inner, "shard_fp32_from_float16_groups", None) or getattr(inner, "fp32_from_float16_groups", None) or []
    return [t for group in groups for t in group]


def adam_state(inner) -> Dict:
    """torch.optim state of one megatron optimizer: parameter -> {exp_avg, exp_avg_sq, step}."""
    return inner.optimizer.state


def unclipped_grad_norm(optimizer) -> float:
    """The global grad norm of the step just taken, for an optimizer that did not clip (megatron
    computes it only when clip_grad > 0); the main grads are still in place after the step."""
    return float(optimizer.get_grad_norm())


def reload_main_params(optimizer) -> None:
    """Copy freshly loaded model weights into the optimizer's fp32 main params."""
    optimizer.reload_model_params()


def owned_optimizer_state(optimizer, named_params: Dict[str, torch.nn.Parameter]) -> Dict[str, dict]:
    """This DP rank's part of the distributed optimizer's state by parameter name: the range of the
    flattened parameter it owns (start, end) and the fp32 main values and Adam moments over it
    (views, not copies). Parameters it owns none of are left out."""
    out: Dict[str, dict] = {}
    for inner in inner_optimizers(optimizer):
        owned = getattr(inner, "model_param_gbuf_map", None)
        if owned is None or getattr(inner, "is_stub_optimizer", False):
            continue
        for name, param in named_params.items():
            if param not in owned:
                continue  # another optimizer of the chain (experts) holds it
            span = inner._get_model_param_range_map(param)["param"]
            if span.size == 0:
                continue
            tensors = inner._get_main_param_and_optimizer_states(param)
            out[name] = {"shape": tuple(param.shape), "start": span.start, "end": span.end,
                         **{k: tensors[k] for k in ("param", "exp_avg", "exp_avg_sq")}}
    return out
