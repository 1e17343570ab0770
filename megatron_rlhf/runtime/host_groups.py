"""Control collectives on the host: the flags, counts, metrics and Python objects the ranks agree on.

On CUDA the device's groups are NCCL, which takes no CPU tensor (and moves every pickled object
through the device). Every control collective goes over the host twin of its group instead: a
gloo group of the same ranks, made where the device groups are made (runtime/distributed.py,
runtime/layouts.py), collectively and in the same order on every rank. On the CPU the twins are
gloo groups of their own too: one code path, and the test that no control path uses a device
group (tests/test_collectives.py) runs without a GPU.
"""

from __future__ import annotations

import datetime
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

_TWINS: Dict[Tuple[int, ...], Optional[object]] = {}  # ranks -> this rank's twin (None: not a member)
_TIMEOUT = [datetime.timedelta(minutes=30)]


def _ranks(group) -> Tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(group)))


def make_host_twins(groups: Iterable, timeout_s: Optional[float] = None) -> None:
    """A host twin for each of this rank's ``groups`` (device groups, None for the world) that has
    none yet; collective over the world (every rank names its own groups of the same kinds)."""
    if timeout_s is not None:
        _TIMEOUT[0] = datetime.timedelta(seconds=timeout_s)
    everyone = tuple(range(dist.get_world_size()))
    if everyone not in _TWINS:
        _TWINS[everyone] = dist.new_group(list(everyone), backend="gloo", timeout=_TIMEOUT[0])
    mine = sorted({_ranks(g) for g in groups})
    gathered = [None] * len(everyone)
    dist.all_gather_object(gathered, mine, group=_TWINS[everyone])
    me = dist.get_rank()
    for ranks in sorted({r for part in gathered for r in part}):
        if ranks not in _TWINS:  # the same sets on every rank, in the same order
            made = dist.new_group(list(ranks), backend="gloo", timeout=_TIMEOUT[0])
            _TWINS[ranks] = made if me in ranks else None


def host_group(group=None):
    """The host twin of ``group`` (the world when None): where a control collective of its ranks goes."""
    twin = _TWINS.get(_ranks(group))
    if twin is None:
        raise RuntimeError(f"no host group over ranks {_ranks(group)}: the device group was made without its twin "
                           "(runtime/host_groups.make_host_twins)")
    return twin


def is_host_group(group) -> bool:
    return group is not None and any(group is twin for twin in _TWINS.values())


def forget_host_groups() -> None:
    """Drop the twins (the world they belong to is being torn down)."""
    _TWINS.clear()


def every_rank(flag: bool, group=None) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (the world when None)."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=host_group(group))
    return bool(value.item())


def host_sum(values, group=None) -> torch.Tensor:
    """The sum over ``group``'s ranks of ``values`` (host numbers, float64)."""
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total, group=host_group(group))
    return total
