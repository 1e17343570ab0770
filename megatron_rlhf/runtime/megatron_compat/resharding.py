"""megatron's resharding (a serving role at a layout of its own): the plan it caches (what a
rank receives; a part of it run alone), and the global names it needs for SequentialMLP's experts."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Tuple

import torch

from megatron_rlhf.runtime.megatron_compat.sites import Site, names_replaced

# What each function here relies on (name -> sites), checked at start-up (megatron_compat.check).
ANCHORS: Dict[str, Tuple[Site, ...]] = {
    "reshard_plan": (  # the plan megatron's resharding caches on the target model (its transfers)
        Site("resharding/refit.py", 'setattr(tgt_core, "_cached_reshard_plan", plan)'),
        Site("resharding/utils.py", "my_slice: tuple[slice, ...]"),
        Site("resharding/utils.py", "@dataclass\nclass ReshardPlan:"),
        Site("resharding/refit.py", "execute_reshard_plan(plan, src_core, tgt_core, service=service)"),
    ),
    "reshard_sequential_experts": (  # resharding names experts globally for TEGroupedMLP's weightK only
        Site("resharding/utils.py", "def assign_ep_resolved_name_inplace("),
        Site("resharding/utils.py", "local_idx = _detect_expert_index_from_param_name(base)"),
        Site("resharding/utils.py", "assign_ep_resolved_name_inplace(meta, base_name=name)"),
    ),
}


def reshard_receives(gpt_model: torch.nn.Module) -> List[Tuple[str, tuple]]:
    """(parameter name, slice) of every receive this rank makes when megatron's resharding serves
    ``gpt_model`` (from the plan it cached on the model's first resharding; [] before)."""
    plan = getattr(gpt_model, "_cached_reshard_plan", None)
    return [] if plan is None else [(op.param_name, op.my_slice) for op in plan.recv_ops]


def reshard_part(src: torch.nn.Module, dst: torch.nn.Module, service, keep: Callable[[str], bool]) -> None:
    """Run only the transfers of the parameters ``keep`` names, from the plan megatron's resharding
    cached on ``dst`` at its first (whole) resharding; collective as that is."""
    from megatron.core.resharding import execute_reshard_plan

    plan = dst._cached_reshard_plan
    part = dataclasses.replace(plan, send_ops=[op for op in plan.send_ops if keep(op.param_name)],
                               recv_ops=[op for op in plan.recv_ops if keep(op.param_name)])
    execute_reshard_plan(part, src, dst, service=service)


def sequential_experts_resharded():
    """megatron's resharding matches an expert's parameters across EP layouts by a global expert
    index it reads only from TEGroupedMLP's names (``weight3``); SequentialMLP's experts
    (``local_experts.3.linear_fc1.weight``, the layout used here) would be matched by their local
    index and refused. Within the block, such names get the global index too: EP rank r of E holds
    experts r * (N / E) ... (r + 1) * (N / E) - 1, as megatron places them."""
    from megatron.core.resharding import utils

    original = utils.assign_ep_resolved_name_inplace

    def resolved(meta, *, base_name=None):
        original(meta, base_name=base_name)
        parts = meta.resolved_name.split(".")
        if not meta.is_ep or meta.global_expert_index is not None or "local_experts" not in parts:
            return
        at = parts.index("local_experts") + 1
        ranks = meta.expert_parallel_group_ranks
        meta.global_expert_index = ranks.index(meta.owner_rank) * (meta.num_experts // len(ranks)) + int(parts[at])
        parts[at] = str(meta.global_expert_index)
        meta.resolved_name = ".".join(parts)

    return names_replaced(utils, assign_ep_resolved_name_inplace=resolved)
