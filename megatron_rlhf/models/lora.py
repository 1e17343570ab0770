"""LoRA adapters on megatron-core's tensor-parallel linears (linear_qkv, linear_proj, linear_fc1,
linear_fc2): out = base(x) + (alpha / rank) x B(A(x)), the base frozen, B zero at the start.

A fused linear carries one adapter per projection it fuses, as PEFT puts them on a Hugging Face
model (linear_qkv: q, k, v; linear_fc1: gate, up): rank r means rank r per projection, and a PEFT
adapter loads and exports exactly. Its A's are stacked ([projections x rank, in]); its B holds the
weight's output rows in megatron's order (linear_qkv's by query group), each row multiplying the
slice of A(x) of its projection (``blocks``).

Each adapted linear keeps its class's forward and its own parameters under their names (a
checkpoint of the base loads as before; a model without adapters shares the base's storage), and
gains two parameters beside its ``weight``, sharded as the base is:

- column-parallel base (output rows split: linear_qkv, linear_fc1): ``lora_a`` [projections x rank,
  in] replicated, ``lora_b`` [out / TP, rank] split by rows as the weight is (linear_fc1's [gate; up]
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
        return output + self.lora_scale * _up(down, self.lora_b, *self.lora_blocks), bias


def _up(down: torch.Tensor, b: torch.Tensor, groups: int, sizes) -> torch.Tensor:
    """B applied to A(x) by projection. down: [..., len(sizes) x rank]; b: [groups x sum(sizes), rank]
    (the rows of each group: sizes[0] of the first projection, then the next's); -> [..., b rows]."""
    if len(sizes) == 1:
        return torch.nn.functional.linear(down, b)
    rank = b.shape[1]
    by_group = b.view(groups, sum(sizes), rank)
    pieces, start = [], 0
    for j, size in enumerate(sizes):
        rows = by_group[:, start:start + size].reshape(groups * size, rank)
        pieces.append(torch.nn.functional.linear(down[..., j * rank:(j + 1) * rank], rows).unflatten(-1, (groups, size)))
        start += size
    return torch.cat(pieces, -1).flatten(-2)


def delta_weight(a: torch.Tensor, b: torch.Tensor, groups: int, sizes) -> torch.Tensor:
    """B A by projection (unscaled): the [out, in] an adapter adds to its weight (the adapter
    applied to every unit input: A's columns)."""
    return _up(a.t(), b, groups, sizes).t()


def blocks(target: str, heads: int, query_groups: int, kv_channels: int, ffn_hidden_size: int, tp: int = 1):
    """(groups, sizes): how the output rows of ``target``'s weight (one TP rank's of ``tp``) fall to
    its projections: linear_qkv per query group [its query heads, its key head, its value head],
    linear_fc1 [gate; up] (each half split over TP), a row-parallel linear one projection."""
    if target == "linear_qkv":
        return query_groups // tp, (heads // query_groups * kv_channels, kv_channels, kv_channels)
    if target == "linear_fc1":
        return 1, (ffn_hidden_size // tp, ffn_hidden_size // tp)
    return 1, (None,)


def arch_blocks(target: str, arch) -> tuple:
    """blocks() of a full (unsharded) weight of the model ``arch`` (a ModelArchConfig)."""
    return blocks(target, arch.num_attention_heads, arch.kv_groups, arch.kv_channels, arch.ffn_hidden_size)


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
        weight, c = module.weight, module.config
        column = target in COLUMN_PARALLEL
        tp, tp_rank = module.tp_group.size(), module.tp_group.rank()
        full_in = weight.shape[1] * (1 if column else tp)
        groups, sizes = blocks(target, c.num_attention_heads, c.num_query_groups, c.kv_channels, c.ffn_hidden_size, tp)
        a = _full_a(_global_name(inner, name) + ".lora_a", (len(sizes) * rank, full_in), seed)
        if not column:
            a = a.chunk(tp, dim=1)[tp_rank]
        module.lora_a = torch.nn.Parameter(a.to(weight.device, weight.dtype))
        # B has the weight's output rows: this rank's (column) or all of them (row).
        module.lora_b = torch.nn.Parameter(torch.zeros(weight.shape[0], rank, device=weight.device, dtype=weight.dtype))
        # megatron's view of which one is split over TP (grad norms count a replicated one once;
        # resharding cuts it as the weight: linear_fc1's B with the weight's stride of 2, gate and up).
        if column:
            set_tensor_model_parallel_attributes(module.lora_b, True, 0, getattr(weight, "partition_stride", 1))
        else:
            set_tensor_model_parallel_attributes(module.lora_a, True, 1, 1)
        module.lora_column, module.lora_scale, module.lora_on = column, alpha / rank, True
        module.lora_blocks = (groups, sizes)
        module.__class__ = _adapted_class(type(module))
        adapted.append(name)
    if not adapted:
        raise ValueError(f"LoRA target_modules {list(targets)} match no linear of the model")
    if inner.config.recompute_granularity is not None and getattr(inner, "pre_process", False):
        # megatron's recompute runs a layer block under a checkpoint whose output needs a gradient only
        # if an input does; with the base frozen the embeddings' output does not, and no adapter
        # would learn (what PEFT's enable_input_require_grads answers for gradient checkpointing).
        inner.embedding.register_forward_hook(_output_requires_grad)
    return adapted


def _output_requires_grad(module, inputs, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


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


def load_adapters(model: torch.nn.Module, state: dict) -> None:
    """Copy ``state`` (local names, this rank's shards) into the adapters; every adapter given."""
    params = {n: p for n, p in unwrap(model).named_parameters() if is_adapter(n)}
    if set(state) != set(params):
        raise ValueError(f"adapters do not fit the model: missing {sorted(set(params) - set(state))[:3]}, "
                         f"unexpected {sorted(set(state) - set(params))[:3]}")
    with torch.no_grad():
        for name, tensor in state.items():
            if tensor.shape != params[name].shape:
                raise ValueError(f"adapter {name}: shape {tuple(tensor.shape)}, the model's {tuple(params[name].shape)}")
            params[name].copy_(tensor)
