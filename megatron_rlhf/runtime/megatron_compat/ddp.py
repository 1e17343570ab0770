"""megatron DDP's contiguous buffers (EMS moves them), its grad-buffer free and restore, and the
grad-sync hooks and per-token loss path that training wires into the model config."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megatron_rlhf.runtime.megatron_compat.sites import Site

# What each function here relies on (name -> sites), checked at start-up (megatron_compat.check).
ANCHORS: Dict[str, Tuple[Site, ...]] = {
    "ddp_buffers": (
        Site("distributed/distributed_data_parallel.py", "self.buffers"),
        Site("distributed/distributed_data_parallel.py", "self.expert_parallel_buffers"),
        Site("distributed/param_and_grad_buffer.py", "self.param_data"),
        Site("distributed/param_and_grad_buffer.py", "self.grad_data"),
        Site("distributed/param_and_grad_buffer.py", "self.params"),
    ),
    "fixed_address_settings": (
        Site("transformer/transformer_config.py", "cuda_graph_impl: Literal['none', 'local', 'transformer_engine']"),
        Site("distributed/distributed_data_parallel_config.py", "nccl_ub: bool = False"),
        Site("distributed/distributed_data_parallel_config.py", "overlap_param_gather: bool = False"),
    ),
    "grad_buffer_free_and_restore": (
        Site("distributed/distributed_data_parallel.py", "def offload_grad_buffers("),
        Site("distributed/distributed_data_parallel.py", "def restore_grad_buffers("),
    ),
    "grad_sync_hooks": (
        Site("model_parallel_config.py", "finalize_model_grads_func"),
        Site("model_parallel_config.py", "no_sync_func"),
        Site("model_parallel_config.py", "grad_sync_func"),
    ),
    "per_token_loss": (  # models/pipeline.py's losses return (sum, tokens); megatron sums the tokens over DP
        Site("pipeline_parallel/schedules.py", "output_tensor, num_tokens, loss_reduced = outputs"),
        Site("distributed/finalize_model_grads.py", "torch.distributed.all_reduce(num_tokens, group=dp_cp_group)"),
        Site("distributed/distributed_data_parallel.py", "if not config.calculate_per_token_loss:"),
    ),
}


def ddp_buffers(model: torch.nn.Module) -> list:
    """megatron DDP's _ParamAndGradBuffers (none for a model without DDP)."""
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return []
    return list(model.buffers) + list(model.expert_parallel_buffers)


def fixed_address_settings(model: torch.nn.Module) -> List[str]:
    """The settings of a built model that need its device storages never to move: CUDA graphs,
    NCCL user buffers, the all-gather of updated weights deferred to the next forward."""
    from megatron.core.distributed import DistributedDataParallel

    found = []
    config = getattr(model, "config", None)  # megatron modules (DDP, Float16Module, GPTModel) carry theirs
    if getattr(config, "cuda_graph_impl", "none") != "none" or getattr(config, "enable_cuda_graph", False):
        found.append(f"cuda_graph_impl={getattr(config, 'cuda_graph_impl', 'local')!r}")
    if isinstance(model, DistributedDataParallel):
        found += [f"{key}=True" for key in ("nccl_ub", "overlap_param_gather") if getattr(model.ddp_config, key)]
    return found


def buffer_param_storage(buffer) -> Optional[torch.Tensor]:
    """The contiguous parameter buffer (only with the distributed optimizer), else None."""
    return buffer.param_data


def buffer_params(buffer) -> list:
    return list(buffer.params)


def buffer_grad_storage(buffer) -> Optional[torch.Tensor]:
    return buffer.grad_data


def free_grad_buffers(ddp_model) -> None:
    """Resize DDP's grad buffers to 0; every main_grad view stays valid (megatron's own method)."""
    ddp_model.offload_grad_buffers(synchronize=True, empty_cache=False)


def restore_grad_buffers(ddp_model) -> None:
    """Grow DDP's grad buffers back, zeroed."""
    ddp_model.restore_grad_buffers(synchronize=False)


def wire_grad_sync(model_config, ddp_model, overlap_grad_reduce: bool) -> None:
    """Let megatron's schedule finalise grads and manage DDP's grad sync for this model."""
    from megatron.core.distributed import finalize_model_grads

    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.no_sync_func = ddp_model.no_sync
    if overlap_grad_reduce:
        model_config.grad_sync_func = ddp_model.start_grad_sync
