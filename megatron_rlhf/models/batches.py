"""Batches as every pass over a rollout reads them (scoring and training alike).

``tokens`` [B, S] hold prompt then response, right-padded. A per-action tensor is [B, S-1]: its
position t belongs to the action "emit token t+1", which the logits at position t chose and which
the value at position t (the state before it) estimates. This module is the one definition of
that convention and of how rows are cut into micro-batches.
"""

from __future__ import annotations

from typing import Dict, List

import torch

MicroBatch = Dict[str, torch.Tensor]


def next_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """The token each position chose: [b, s] -> [b, s] (the last position's entry has no meaning;
    ``at_actions`` drops it)."""
    return torch.roll(tokens, -1, dims=1)


def at_actions(per_position: torch.Tensor) -> torch.Tensor:
    """A per-position tensor [b, s, ...] restricted to the action positions: [b, s-1, ...]."""
    return per_position[:, :-1]


def state_values(output: torch.Tensor) -> torch.Tensor:
    """A scalar head's output [b, s, 1] as the value of each state before an action: [b, s-1] (fp32)."""
    return at_actions(output.float().squeeze(-1))


def action_mask(width: int, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """[B, width-1] float mask: 1 at position t when token t+1 is a response token."""
    positions = torch.arange(1, width, device=prompt_lengths.device).unsqueeze(0)
    start = prompt_lengths.unsqueeze(1)
    return ((positions >= start) & (positions < start + response_lengths.unsqueeze(1))).to(torch.float32)


def split_rows(size: int, **columns: torch.Tensor) -> List[MicroBatch]:
    """The rows of every column, cut into micro-batches of ``size`` rows."""
    rows = next(iter(columns.values())).shape[0]
    if rows % size:
        raise ValueError(f"{rows} rows do not split into micro-batches of {size}")
    return [{k: v[i : i + size] for k, v in columns.items()} for i in range(0, rows, size)]
