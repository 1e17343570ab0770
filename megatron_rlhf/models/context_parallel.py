"""Context parallelism without transformer-engine: each sequence divided over the CP ranks.

A micro-batch's rows, padded to a multiple of 2 x CP positions, are cut into 2 x CP chunks along the
sequence; CP rank r holds chunks r and 2CP-1-r (megatron's placement, which gives every rank the same
share of causal attention's work). The model sees only its rank's tokens: megatron's rotary embedding
slices its angles the same way (each token at its true position), and the core attention
(models/attention.py) gathers the CP group's keys and values, puts them in sequence order and runs
each local chunk's queries over the keys up to the chunk's end, causal from the bottom right (or
within the sliding window's band). The gather is megatron's sequence-parallel one over the CP group:
its backward reduce-scatters the keys' and values' gradients to the ranks that made them.

Losses read the local view of a micro-batch (:func:`on_this_rank`): every per-position and
per-action column cut to the rank's positions, with the next token each position chose in
``LABELS`` (the chunks are not contiguous, so it cannot be read off the local tokens). A loss that
is a sum over tokens is then the rank's part of the row's; megatron sums the gradients and the
token counts over DP x CP, so a step's gradient is the one of CP=1. A loss of a row's whole sum (a
sequence's log-prob, a score at its last token) takes it by :func:`row_sums` (summed over the CP
group, each rank's gradient through its own positions) and counts itself on one rank of the group
(:func:`counted_once`). Forward-only results are put back in sequence order on every CP rank
(:func:`whole_sequence`).

Every rank of a CP group holds the same rows (the data is cut over DP only); a rank's keys and
values of the whole sequence live for the layer's backward (all-gather, as transformer-engine's
``all_gather`` CP type; its ring exchange overlaps the transfer on a GPU, which this path does not).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_rlhf.models.batches import LABELS, next_tokens

CP_GROUP = "cp_group"  # a CP view's process group (not a tensor)


def padded_length(length: int, cp: int) -> int:
    """``length`` rounded up to whole chunks: a multiple of 2 x CP."""
    return -(-length // (2 * cp)) * (2 * cp)


def chunks_of(rank: int, cp: int) -> Tuple[int, int]:
    """The two chunks CP rank ``rank`` holds, in the order its local positions run."""
    return rank, 2 * cp - 1 - rank


def local_positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions of a padded row of ``length`` that CP rank ``rank`` holds: [length / CP]."""
    chunk = padded_length(length, cp) // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks_of(rank, cp)])


def sequence_order(cp: int, chunk: int, device=None) -> torch.Tensor:
    """Where each position of the sequence is in the CP group's gathered positions (every rank's
    local positions, in rank order): [2 x CP x chunk]."""
    held = torch.cat([local_positions(2 * cp * chunk, cp, r) for r in range(cp)])
    return torch.argsort(held).to(device)


def on_this_rank(mb: Dict[str, torch.Tensor], group) -> Dict[str, torch.Tensor]:
    """The micro-batch as this rank of CP group ``group`` reads it: ``tokens`` [b, s] and every
    column of width s (per position) or s - 1 (per action, models/batches.py) padded to whole chunks
    and cut to the rank's positions, ``LABELS`` the next token at each, ``position_ids`` the true
    positions; other columns (per row) whole."""
    if mb.get("attention_mask") is not None:
        raise ValueError("context parallelism: an explicit attention mask is not divided over the CP ranks; "
                         "causal attention over right-padded rows only")
    tokens = mb["tokens"]
    length, cp = tokens.shape[1], group.size()
    width = padded_length(length, cp)
    mine = local_positions(length, cp, group.rank(), tokens.device)

    def cut(column: torch.Tensor) -> torch.Tensor:
        pad = [0, 0] * (column.dim() - 2) + [0, width - column.shape[1]]
        return F.pad(column, pad).index_select(1, mine)

    local = {}
    for key, column in mb.items():
        sequence_wide = column is not None and column.dim() >= 2 and column.shape[1] in (length, length - 1)
        local[key] = cut(column) if sequence_wide and key != "position_ids" else column
    padded = F.pad(tokens, (0, width - length))
    local[LABELS] = next_tokens({"tokens": padded}).index_select(1, mine)
    local["position_ids"] = mine.unsqueeze(0).expand(tokens.shape[0], -1)
    local[CP_GROUP] = group
    return local


def row_sums(partial: torch.Tensor, mb: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-row sums over a row's positions (``partial`` [b, ...], this view's part of each): the whole
    row's, summed over a CP view's group (its backward the identity, so each rank's gradient flows
    through its own positions); outside a CP view ``partial`` itself."""
    group = mb.get(CP_GROUP)
    if group is None:
        return partial
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(partial, group)


def at_positions(per_position: torch.Tensor, positions: torch.Tensor, mb: Dict[str, torch.Tensor]) -> torch.Tensor:
    """per_position [b, s] at each row's ``positions`` [b] (true positions: a row's last token): [b],
    from whichever CP rank holds it (row_sums of this rank's, zero where it does not)."""
    if CP_GROUP not in mb:
        return per_position.gather(1, positions.unsqueeze(1)).squeeze(1)
    held = mb["position_ids"] == positions.unsqueeze(1)  # [b, local positions]
    return row_sums((per_position * held).sum(dim=1), mb)


def counted_once(mb: Dict[str, torch.Tensor]) -> float:
    """1.0, or 0.0 on all but the first rank of a CP view's group: a loss or figure every CP rank
    computes whole (of row_sums) is counted by one of them, so that sums over DP x CP count it once."""
    group = mb.get(CP_GROUP)
    return 1.0 if group is None or group.rank() == 0 else 0.0


def whole_sequence(local: torch.Tensor, group, length: int) -> torch.Tensor:
    """A per-position result [b, length / CP (padded), ...] of every rank of ``group`` -> [b, length, ...]
    in sequence order, on every rank (forward only)."""
    import torch.distributed as dist

    cp = group.size()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    gathered = torch.cat(parts, dim=1)
    order = sequence_order(cp, local.shape[1] // 2, local.device)
    return gathered.index_select(1, order)[:, :length]


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group, scale: float,
              band: Optional[Callable[[int, int], torch.Tensor]] = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.
    query [2c, b, heads, dim], key/value [2c, b, groups, dim] (this rank's two chunks of c positions)
    -> context [2c, b, heads, dim]. ``band(queries, keys)``: which keys each of the last ``queries``
    of ``keys`` positions may read ([queries, keys] booleans: a sliding window's); None: causal from
    the bottom right (torch's CausalBias, a fused kernel's own mask on a GPU)."""
    from torch.nn.attention.bias import causal_lower_right

    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    cp, rank = group.size(), group.rank()
    chunk = query.shape[0] // 2
    order = sequence_order(cp, chunk, query.device)
    keys, values = (gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=group)
                    .index_select(0, order) for t in (key, value))
    contexts = []
    for j, c in enumerate(chunks_of(rank, cp)):
        end = (c + 1) * chunk  # the chunk's queries read keys 0..end-1
        q = query[j * chunk : (j + 1) * chunk].permute(1, 2, 0, 3)  # [b, heads, c, dim]
        k, v = (t[:end].permute(1, 2, 0, 3) for t in (keys, values))
        mask = causal_lower_right(chunk, end) if band is None else band(chunk, end)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        contexts.append(context.permute(2, 0, 1, 3))
    return torch.cat(contexts)

