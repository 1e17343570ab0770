"""Process groups of a parallel layout other than the run's. megatron's global parallel_state holds
one layout; a model of another (a serving role at its own TP/PP) is built on a ProcessGroupCollection
of its own, which megatron-core's models and its resharding take in place of the global groups.

The groups of a layout are made once, on every rank in the same order (``new_group`` is collective
over the world), numbered as megatron numbers ranks (its RankGenerator, order tp-cp-ep-dp-pp), each
with its host twin for control collectives (runtime/host_groups.py).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

_BUILT: Dict[Tuple[int, int, int], object] = {}  # (tp, pp, ep) -> groups


def layout_groups(tp: int, pp: int, ep: int = 1):
    """This rank's ProcessGroupCollection for the layout TP x PP x DP (DP = world / (TP x PP)), with
    experts split over EP ranks taken from the DP ones (each expert split over TP, as megatron's
    default expert TP; expert DP = DP / EP)."""
    import torch.distributed as dist
    from megatron.core.parallel_state import RankGenerator

    from megatron_rlhf.runtime.host_groups import make_host_twins
    from megatron.core.process_groups_config import ProcessGroupCollection

    key = (tp, pp, ep)
    if key in _BUILT:
        return _BUILT[key]
    world = dist.get_world_size()
    if world % (tp * pp) or (world // (tp * pp)) % ep:
        raise ValueError(f"a layout of TP={tp} x PP={pp} x EP={ep} does not divide the world of {world} ranks")
    dp = world // (tp * pp)
    ranks = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    experts = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    me = dist.get_rank()

    def group(enumeration: List[List[int]]):
        found = None
        for members in enumeration:
            made = dist.new_group(sorted(set(members)))
            if me in members:
                found = made
        return found

    pipelines = ranks.get_ranks("pp")
    groups = {kind.replace("-", "_"): group(ranks.get_ranks(kind))
              for kind in ("tp", "cp", "dp", "pp", "tp-pp", "tp-cp", "dp-cp", "tp-dp-cp")}
    groups["mp"] = groups.pop("tp_pp")
    # The tied embedding's group (first and last stage) and the position embedding's (first stage).
    groups["embd"] = group([[p[0], p[-1]] for p in pipelines])
    groups["pos_embd"] = group([[p[0]] for p in pipelines])
    # The experts' groups, numbered as megatron numbers them (its expert rank generator).
    groups.update(ep=group(experts.get_ranks("ep")), expt_tp=group(experts.get_ranks("tp")),
                  tp_ep=group(experts.get_ranks("tp-ep")), tp_ep_pp=group(experts.get_ranks("tp-ep-pp")),
                  expt_dp=group(experts.get_ranks("dp")))
    _BUILT[key] = ProcessGroupCollection(**groups)
    make_host_twins([groups[kind] for kind in ("dp", "tp", "pp", "mp", "ep")])
    return _BUILT[key]


def forget_layouts() -> None:
    """Drop the groups made (the world they belong to is being torn down)."""
    _BUILT.clear()
