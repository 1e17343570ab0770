"""LoRA adapters on megatron-core's tensor-parallel linears (linear_qkv, linear_proj, linear_fc1,
linear_fc2): out = base(x) + (alpha / rank) x B(A(x)), the base frozen, B zero at the start.

Each adapted linear keeps its class's forward and its own parameters under their names (a
checkpoint of the base loads as before; a model without adapters shares the base's storage), and
gains two parameters beside its ``weight``, sharded as the base is:

- column-parallel base (output rows split: linear_qkv, linear_fc1): ``lora_a`` [rank, in]
  replicated, ``lora_b`` [out / TP, rank] split by rows as the weight is (linear_fc1's [gate; up]
  halves each split); A(x) enters the TP region by megatron's copy (its gradient is all-reduced);
- row-parallel base (input columns split: linear_proj, linear_fc2): ``lora_a`` [rank, in / TP]
  split by columns, its partial products all-reduced, ``lora_b`` [out, rank] replicated.

A is drawn from a generator keyed by the run's seed and the parameter's (global) name, whole, then
cut for the rank: the adapters start the same at every layout. ``adapters_off(model)`` runs the base
alone, for comparing an adapted model with its base (the reference of a LoRA run is not this: it is
a model of its own whose parameters are views of ppo_policy's base weights).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator, List

import torch

from megatron_rlhf.config.names import LORA_TARGETS
from megatron_rlhf.models.decoder import unwrap

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")  # the rest of LORA_TARGETS are row-parallel
ADAPTER_NAMES = ("lora_a", "lora_b")


class _Adapted:
    """Mixed into an adapted linear's class, before it: the base forward, plus the adapter's."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if not self.lora_on:
            return output, bias
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   reduce_from_tensor_model_parallel_region)

        down = torch.nn.functional.linear(input_, self.lora_a)
        if self.lora_column:
            down = copy_to_tensor_model_parallel_region(down, group=self.tp_group)
        else:
            down = reduce_from_tensor_model_parallel_region(down, group=self.tp_group)
        return output + self.lora_scale * torch.nn.functional.linear(down, self.lora_b), bias


_CLASSES = {}


def _adapted_class(cls):
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (_Adapted, cls), {})
    return _CLASSES[cls]


def _full_a(name: str, shape, seed: int) -> torch.Tensor:
    """A's whole initial value (PEFT's: Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))),
    from a generator of its own (seed, name): the same whatever the layout."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


def _global_name(model: torch.nn.Module, name: str) -> str:
    """``name`` with the pipeline stage's local layer number made global (megatron's layer_number - 1)."""
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        return name
    layer = model.decoder.layers[int(parts[2])]
    return ".".join(parts[:2] + [str(layer.layer_number - 1)] + parts[3:])


def add_adapters(model: torch.nn.Module, rank: int, alpha: float, targets, seed: int) -> List[str]:
    """Adapt every linear of ``model`` (this rank's shard; before megatron DDP wraps it) whose name
    ends with one of ``targets``; freeze everything else. Returns the adapted linears' names.
    Refuses the experts' linears and transformer-engine's norm-fused linears by name."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(f"LoRA target_modules {unknown} are not adapter targets; choose from {', '.join(LORA_TARGETS)}")
    inner = unwrap(model)
    for p in inner.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, module in inner.named_modules():
        target = name.rsplit(".", 1)[-1]
        if target not in targets:
            continue
        if ".experts." in name:
            raise ValueError(f"LoRA on the experts' linears ({name}) is not supported yet; target the attention "
                             "(linear_qkv, linear_proj) of a model with experts")
        if hasattr(module, "layer_norm_weight"):
            raise ValueError(f"LoRA on transformer-engine's norm-fused {name} is not supported yet (the adapter "
                             "must see the normalised input); run with megatron's local layers")
        weight = module.weight
        column = target in COLUMN_PARALLEL
        tp, tp_rank = module.tp_group.size(), module.tp_group.rank()
        full_in = weight.shape[1] * (1 if column else tp)
        a = _full_a(_global_name(inner, name) + ".lora_a", (rank, full_in), seed)
        if not column:
            a = a.chunk(tp, dim=1)[tp_rank]
        module.lora_a = torch.nn.Parameter(a.to(weight.device, weight.dtype))
        # B has the weight's output rows: this rank's (column) or all of them (row).
        module.lora_b = torch.nn.Parameter(torch.zeros(weight.shape[0], rank, device=weight.device, dtype=weight.dtype))
        # megatron's view of which one is split over TP (grad norms count a replicated one once).
        set_tensor_model_parallel_attributes(module.lora_b if column else module.lora_a, True, 0 if column else 1, 1)
        module.lora_column, module.lora_scale, module.lora_on = column, alpha / rank, True
        module.__class__ = _adapted_class(type(module))
        adapted.append(name)
    if not adapted:
        raise ValueError(f"LoRA target_modules {list(targets)} match no linear of the model")
    return adapted


def adapted_linears(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    return (m for m in unwrap(model).modules() if isinstance(m, _Adapted))


def has_adapters(model: torch.nn.Module) -> bool:
    return next(adapted_linears(model), None) is not None


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Within: ``model`` computes its base alone."""
    linears = list(adapted_linears(model))
    for m in linears:
        m.lora_on = False
    try:
        yield
    finally:
        for m in linears:
            m.lora_on = True


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` is an adapter's."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES
