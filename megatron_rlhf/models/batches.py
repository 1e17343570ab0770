"""Batches as every pass over a rollout reads them (scoring and training alike).

``tokens`` [B, S] hold prompt then response, right-padded. A per-action tensor is [B, S-1]: its
position t belongs to the action "emit token t+1", which the logits at position t chose and which
the value at position t (the state before it) estimates. This module is the one definition of
that convention and of how rows are cut into micro-batches.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

MicroBatch = Dict[str, torch.Tensor]
# The next token each position chose, where a micro-batch holds it: a context-parallel rank's view,
# whose positions are not contiguous (models/context_parallel.py), or a packed one's (models/packed_rows.py).
LABELS = "labels"
# Each row's real tokens [b]: a micro-batch's rows may be packed for the model's pass by them.
ROW_LENGTHS = "row_lengths"
# A packed view's PackedRows (models/packed_rows.py): the pass's input, and the way back to rows.
PACKED = "packed_rows"


def next_tokens(mb: MicroBatch) -> torch.Tensor:
    """The token each position of ``mb`` chose: [b, s] (the last position's entry has no meaning;
    ``at_actions`` drops it). A context-parallel rank's view holds its own (models/context_parallel.py)."""
    labels = mb.get(LABELS)
    return torch.roll(mb["tokens"], -1, dims=1) if labels is None else labels


def at_actions(per_position: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """A per-position tensor [b, s, ...] of ``mb`` restricted to the action positions: [b, s-1, ...].
    In a context-parallel rank's view the per-action columns are cut to the rank's positions as the
    per-position ones are (the last, padding, has a zero mask): nothing is dropped. In a packed view
    ``per_position`` is the packed row's [1, T, ...], put back in rows first."""
    packed = mb.get(PACKED)
    if packed is not None:
        return packed.as_rows(per_position)[:, :-1]
    return per_position if LABELS in mb else per_position[:, :-1]


def state_values(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """A scalar head's output [b, s, 1] as the value of each state before an action: [b, s-1] (fp32)."""
    return at_actions(output.float().squeeze(-1), mb)


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


def length_grouped(size: int, lengths: torch.Tensor, **columns: torch.Tensor) -> Tuple[List[MicroBatch], torch.Tensor]:
    """The rows, longest first (ties in row order), cut into micro-batches of ``size`` rows, each
    trimmed to its own longest row ``w`` (``lengths`` [B]: real tokens per row): a column
    [B, S, ...] to [b, w, ...], a per-action column [B, S-1, ...] to [b, w-1, ...], a per-row column
    [B] whole. The trimmed positions are padding: causal attention never lets them reach the kept
    ones, and every loss and pass masks them. Returns the micro-batches and the row order
    (the original index of each row, in micro-batch order)."""
    rows = lengths.shape[0]
    if rows % size:
        raise ValueError(f"{rows} rows do not split into micro-batches of {size}")
    order = torch.sort(lengths, descending=True, stable=True).indices
    return _cut(order, [size] * (rows // size), lengths, columns), order


def token_packed(budget: int, lengths: torch.Tensor, equal_rows: bool = False, real_tokens: bool = False,
                 **columns: torch.Tensor) -> Tuple[List[MicroBatch], torch.Tensor]:
    """As :func:`length_grouped`, but each micro-batch takes rows (longest first) while its tokens
    stay within ``budget``: rows x its longest row, or with ``real_tokens`` (packed rows) the sum of
    its rows' real tokens; as few micro-batches as fit, of any number of rows. ``equal_rows``
    (pipeline parallelism with padded rows: the stages exchange one shape of rows): every
    micro-batch has the same number of rows, the most that divides the rows and keeps the longest
    within the budget. A row longer than the budget is refused (ValueError)."""
    order = torch.sort(lengths, descending=True, stable=True).indices
    sizes = packed_sizes([int(n) for n in lengths[order].tolist()], budget, equal_rows, real_tokens)
    return _cut(order, sizes, lengths, columns), order


def packed_sizes(longest_first: List[int], budget: int, equal_rows: bool = False,
                 real_tokens: bool = False) -> List[int]:
    """The rows of each micro-batch of :func:`token_packed`, for row lengths sorted longest first:
    as many rows as keep rows x the micro-batch's longest (``real_tokens``: the rows' sum) within
    ``budget`` (``equal_rows``: one count for all, dividing the rows). A row longer than the budget
    is refused (ValueError)."""
    longest = [max(n, 2) for n in longest_first]
    if longest and max(longest) > budget:
        raise ValueError(f"a row of {max(longest)} tokens does not fit in max_tokens_per_micro_batch={budget}")
    if equal_rows:
        rows = max(r for r in range(1, len(longest) + 1) if len(longest) % r == 0 and r * longest[0] <= budget)
        return [rows] * (len(longest) // rows)
    sizes, first = [], 0
    while first < len(longest):
        if real_tokens:
            rows, tokens = 0, 0
            while first + rows < len(longest) and tokens + longest[first + rows] <= budget:
                tokens += longest[first + rows]
                rows += 1
        else:
            rows = min(max(1, budget // longest[first]), len(longest) - first)  # the first row is the longest
        sizes.append(rows)
        first += rows
    return sizes


def _cut(order: torch.Tensor, sizes: List[int], lengths: torch.Tensor, columns: Dict[str, torch.Tensor]) -> List[MicroBatch]:
    """Micro-batches of ``sizes`` rows taken in ``order``, each trimmed to its own longest row and
    holding its rows' real lengths (``ROW_LENGTHS``)."""
    width = columns["tokens"].shape[1]
    batches, first = [], 0
    for size in sizes:
        picked = order[first : first + size]
        first += size
        w = max(int(lengths[picked].max()), 2)  # an action needs two positions
        mb = {ROW_LENGTHS: lengths[picked]}
        for name, column in columns.items():
            column = column[picked]
            if column.dim() > 1 and column.shape[1] == width:
                column = column[:, :w]
            elif column.dim() > 1 and column.shape[1] == width - 1:
                column = column[:, : w - 1]
            mb[name] = column
        batches.append(mb)
    return batches


def dealt_by_tokens(lengths: torch.Tensor, parts: int, part: int) -> torch.Tensor:
    """Part ``part`` of ``parts`` equal shares of rows (``lengths`` [B]: real tokens, B divisible by
    ``parts``) whose real tokens are near equal: the rows dealt longest first, each round of
    ``parts`` in turn forward and back (0..P-1, P-1..0, ...). The indices of the part's rows."""
    order = torch.sort(lengths, descending=True, stable=True).indices
    rounds = order.view(-1, parts).clone()
    rounds[1::2] = rounds[1::2].flip(1)
    return rounds[:, part]


def micro_batches_of(role_config, lengths: torch.Tensor, pipelined: bool = False,
                     **columns: torch.Tensor) -> Tuple[List[MicroBatch], torch.Tensor]:
    """A role's micro-batches of these rows (RoleConfig: rows per micro-batch, or a token budget of
    padded or, with ``pack_rows``, real tokens; ``pipelined``: the role runs at PP > 1, so its
    micro-batches of padded rows have equal rows)."""
    if role_config.token_budget is not None:
        packs = role_config.pack_rows
        return token_packed(role_config.token_budget, lengths, equal_rows=pipelined and not packs, real_tokens=packs,
                            **columns)
    return length_grouped(role_config.micro_batch_size, lengths, **columns)


def ungrouped(parts: List[torch.Tensor], order: torch.Tensor, width: int, fill: float = 0) -> torch.Tensor:
    """Per-micro-batch results [b, w_i, ...] of :func:`length_grouped` micro-batches back in the
    original row order, padded with ``fill`` to ``width``: [B, width, ...] (per-row results [b] likewise)."""
    if parts[0].dim() > 1:
        parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1]), value=fill) for p in parts]
    grouped = torch.cat(parts)
    out = torch.empty_like(grouped)
    out[order.to(grouped.device)] = grouped
    return out
