"""A rollout's rows and how a layout cuts them over its data-parallel ranks.

Sample rows are a dict of columns, one row per response: [B, S] tokens (and with routing replay
[B, S, L, K] routes) over every position, [B, S-1] per-action columns, [B] per-row ones. A layout
of DP ranks gives rank r the r-th of DP equal, consecutive shares of the rollout. Roles of another
layout (runtime/layouts.py) see other shares: the rows go to them and back through ``recut``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_rlhf.models.routing import ROUTES

SampleRows = Dict[str, torch.Tensor]
# The columns over every position [B, S, ...]; the others with a width are per action [B, S-1].
FULL_WIDTH = ("tokens", ROUTES)


def width_of(rows: SampleRows) -> Optional[int]:
    """The positions the rows span (a per-action column spans one fewer); None without a width."""
    widths = [v.shape[1] + (k not in FULL_WIDTH) for k, v in rows.items() if v.dim() > 1]
    return max(widths) if widths else None


def cat_rows(parts: List[SampleRows], pad_id: int, width: Optional[int] = None) -> SampleRows:
    """Sample rows of several parts, one after another, padded to a common width (``width`` or
    the widest part's): tokens with the pad id, routes with -1 (none recorded), per-action columns with 0."""
    width = width or max(width_of(p) or 0 for p in parts)
    fills = {"tokens": pad_id, ROUTES: -1}

    def pad(key, tensor):
        if tensor.dim() < 2:
            return tensor
        missing = width - (0 if key in FULL_WIDTH else 1) - tensor.shape[1]
        return torch.nn.functional.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, missing), value=fills.get(key, 0))

    return {k: torch.cat([pad(k, p[k]) for p in parts]) for k in parts[0]}


def trimmed(rows: SampleRows, width: Optional[int] = None) -> SampleRows:
    """Every column cut to ``width`` positions (default: the longest row's prompt and response)."""
    if width is None:
        width = int((rows["prompt_lengths"] + rows["response_lengths"]).max())
    return {k: v[:, : width - (k not in FULL_WIDTH)] if v.dim() > 1 else v for k, v in rows.items()}


@dataclasses.dataclass
class RowCut:
    """The share of the rollout a layout's DP rank holds: rank ``rank`` of ``size`` over ``group``."""

    group: object
    rank: int
    size: int

    @classmethod
    def of(cls, dp_group) -> "RowCut":
        return cls(dp_group, dp_group.rank(), dp_group.size())

    def gather(self, rows: SampleRows, pad_id: int) -> SampleRows:
        """Every DP rank's rows (equal counts), in DP-rank order, padded to the widest."""
        if self.size == 1:
            return rows
        width = torch.tensor([width_of(rows) or 0], device=next(iter(rows.values())).device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=self.group)
        padded = cat_rows([rows], pad_id, int(width))
        return {k: self.gather_tensor(v) for k, v in padded.items()}

    def gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's [n, ...] share of a DP-split tensor -> the whole [n * DP, ...], in DP-rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts)

    def share(self, rows: SampleRows) -> SampleRows:
        """This rank's consecutive share of the whole rollout's ``rows``."""
        count = len(next(iter(rows.values())))
        if count % self.size:
            raise ValueError(f"{count} rows do not split evenly over {self.size} data-parallel ranks")
        n = count // self.size
        return {k: v[self.rank * n : (self.rank + 1) * n] for k, v in rows.items()}


def recut(rows: SampleRows, held: RowCut, wanted: RowCut, pad_id: int) -> SampleRows:
    """Rows held in cut ``held`` -> this rank's share in cut ``wanted`` (collective over both groups)."""
    if held == wanted:
        return rows
    return wanted.share(held.gather(rows, pad_id))
