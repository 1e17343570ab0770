"""megatron's tensor-parallel layers: each parallel linear's local product (replaced on CPU for
the engine) and the vocab-parallel cross entropy over a TP group other than the run's."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from megatron_rlhf.runtime.megatron_compat.sites import Site, names_replaced, methods_replaced

# What each function here relies on (name -> sites), checked at start-up (megatron_compat.check).
ANCHORS: Dict[str, Tuple[Site, ...]] = {
    "linear_matmul": (  # each parallel linear's local product, looked up on the module at call time
        Site("tensor_parallel/layers.py", "def _forward_impl(self, input, weight, *args, **kwargs):"),
        Site("tensor_parallel/layers.py", "output_parallel = self._forward_impl(\n            input=input_parallel,"),
    ),
    "column_input_kept": (  # the column-parallel product's TP handling of its input, done here instead
        Site("tensor_parallel/layers.py", "allreduce_dgrad=allreduce_dgrad,\n            sequence_parallel=False if self.explicit_expert_comm else self.sequence_parallel,"),
        Site("tensor_parallel/layers.py", "            tp_group=self.tp_group,\n        )\n\n        gather_output = self.gather_output"),
    ),
    "cross_entropy_tp_group": (  # reads the global TP group; a model of its own layout passes its own
        Site("tensor_parallel/cross_entropy.py", "group=get_tensor_model_parallel_group()"),
        Site("tensor_parallel/cross_entropy.py", "rank = get_tensor_model_parallel_rank()"),
        Site("tensor_parallel/cross_entropy.py", "world_size = get_tensor_model_parallel_world_size()"),
    ),
}


Matmul = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def linear_matmuls_replaced(model: torch.nn.Module, matmul: Matmul):
    """Within the block, every column- and row-parallel linear of ``model`` computes its local
    product as ``matmul(input, weight, bias)`` (megatron still does the TP communication around
    it), except where megatron gathers a sequence-parallel input inside the product: there its own."""
    return methods_replaced(*_local_products(model, matmul))


def replace_linear_matmuls(model: torch.nn.Module, matmul: Matmul) -> None:
    """linear_matmuls_replaced for the model's life."""
    linears, name, make = _local_products(model, matmul)
    for i, linear in enumerate(linears):
        setattr(linear, name, make(i, linear))


def _local_products(model: torch.nn.Module, matmul: Matmul):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    def local_product(_, linear):
        megatron_own = linear._forward_impl

        def forward_impl(input, weight, bias, sequence_parallel=False, **rest):
            if sequence_parallel:
                return megatron_own(input=input, weight=weight, bias=bias, sequence_parallel=True, **rest)
            return matmul(input, weight, bias)
        return forward_impl

    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    return linears, "_forward_impl", local_product


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None) -> torch.Tensor:
    """megatron's vocab-parallel cross entropy over ``tp_group`` (default: the run's TP group).
    megatron's reads the global TP group, its rank and size in its forward (the backward needs
    none): for another group they are pointed at it for the call."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import cross_entropy

    if tp_group is None or tp_group is parallel_state.get_tensor_model_parallel_group():
        return cross_entropy.vocab_parallel_cross_entropy(logits, target)
    with names_replaced(cross_entropy, get_tensor_model_parallel_group=lambda *a, **k: tp_group,
                                get_tensor_model_parallel_rank=lambda *a, **k: tp_group.rank(),
                                get_tensor_model_parallel_world_size=lambda *a, **k: tp_group.size()):
        return cross_entropy.vocab_parallel_cross_entropy(logits, target)


def column_input_kept(linear: torch.nn.Module, weights: list):
    """Within the block, the column-parallel ``linear`` returns its input as its product would
    see it (gathered over the sequence under sequence parallel; its gradient all-reduced over TP,
    as megatron's product does with ``allreduce_dgrad``) instead of the product, and appends the
    weight each call used to ``weights`` (a tied LM head is handed the embedding's): the caller
    computes the product itself, a piece at a time (models/vocab_parallel.py)."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    def forward_impl(input, weight, bias, allreduce_dgrad=False, sequence_parallel=False, tp_group=None, **rest):
        if bias is not None:
            raise ValueError("an LM head with a bias is not modelled by the chunked log-probs")
        group = tp_group if tp_group is not None else linear.tp_group
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=group)
        weights.append(weight)
        return _ContiguousGrad.apply(input)

    return methods_replaced([linear], "_forward_impl", lambda _, __: forward_impl)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient leaves contiguous: the gradient of a kept head input arrives as the
    transpose GPTModel made of the head's output, and megatron's TP all-reduce of a gradient
    reduces ``grad.contiguous()``, a copy it then drops, where the gradient is not contiguous."""

    @staticmethod
    def forward(ctx, input):
        return input.view_as(input)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()
