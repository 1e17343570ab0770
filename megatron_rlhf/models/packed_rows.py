"""Packed rows: a micro-batch's rows laid end to end without their padding for the model's pass.

A micro-batch of b right-padded rows [b, w], their real lengths in ``ROW_LENGTHS`` (models/batches.py),
runs through the model as one row of T = sum(lengths) tokens (rounded up to a multiple of TP under
sequence parallelism by one more row of padding): megatron's ``thd`` layout and its
``PackedSeqParams`` (cumulative lengths). megatron's rotary embedding then gives each token its
position within its own row (rope_utils' thd path), and the core attention (models/attention.py)
keeps each row's queries to its own row's keys (:func:`attention`): no position is computed for
padding, and a row's numbers are the ones it has alone.

The losses read rows as ever. A pass's output is put back in rows at once (:meth:`PackedRows.as_rows`,
padding zero): a scalar head's [b, w, 1] and whole logits. An LM head read in chunks
(vocab_parallel.ChunkedLogits) computes its log-probs and entropy over the packed tokens (the
next token of each in ``LABELS``) and ``at_actions`` puts them in rows: the vocabulary's product
never runs on padding either.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_rlhf.models.batches import LABELS, PACKED, ROW_LENGTHS, MicroBatch


@dataclasses.dataclass
class PackedRows:
    """What the model reads of a packed micro-batch, and the way back to its rows."""

    tokens: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]: each token's position within its row
    params: object  # megatron's PackedSeqParams (thd, the rows' cumulative lengths)
    places: torch.Tensor  # [b * w]: where each (row, position) is in the packed row; T for padding
    shape: Tuple[int, int]  # (b, w)

    def as_rows(self, packed: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """A per-token result [1, T, ...] of the packed row -> [b, w, ...], ``fill`` at the padding."""
        flat = F.pad(packed[0], (0, 0) * (packed.dim() - 2) + (0, 1), value=fill)
        return flat.index_select(0, self.places).view(*self.shape, *packed.shape[2:])


def packed(mb: MicroBatch, multiple: int = 1, model_columns: Optional[Dict[str, float]] = None) -> MicroBatch:
    """``mb`` with its packed row under ``PACKED`` and each packed token's next token in ``LABELS``
    (the last of a row reads the next row's first: that position has no action); the other columns
    stay rows but ``model_columns`` (name -> the fill of the padding row), per-position columns the
    model itself reads, packed as the tokens are. ``multiple``: the packed length is rounded up to it
    by one more row of padding."""
    if mb.get("attention_mask") is not None:
        raise ValueError("packed rows: an explicit attention mask is not packed; causal attention over right-padded rows only")
    from megatron.core.packed_seq_params import PackedSeqParams

    tokens, lengths = mb["tokens"], mb[ROW_LENGTHS]
    b, w = tokens.shape
    kept = torch.arange(w, device=tokens.device).unsqueeze(0) < lengths.unsqueeze(1)  # [b, w]
    real = tokens[kept]
    total = real.numel()
    extra = -total % multiple
    row_lengths = lengths.tolist() + ([extra] if extra else [])
    cumulative = torch.tensor([0] + row_lengths, device=tokens.device).cumsum(0).to(torch.int32)
    longest = max(row_lengths)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cumulative, cu_seqlens_kv=cumulative,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    places = torch.full((b * w,), total + extra, dtype=torch.long, device=tokens.device)
    places[kept.flatten()] = torch.arange(total, device=tokens.device)
    row = F.pad(real, (0, extra)).unsqueeze(0)
    positions = torch.cat([torch.arange(n, device=tokens.device) for n in row_lengths]).unsqueeze(0)
    view = dict(mb)
    view[PACKED] = PackedRows(row, positions, params, places, (b, w))
    view[LABELS] = torch.roll(row, -1, dims=1)
    for name, fill in (model_columns or {}).items():
        if mb.get(name) is not None:
            column = mb[name][kept]
            view[name] = F.pad(column, (0, 0) * (column.dim() - 1) + (0, extra), value=fill).unsqueeze(0)
    return view


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params, scale: float,
              band: Optional[Callable[[int, int], torch.Tensor]] = None) -> torch.Tensor:
    """Each packed row's queries over its own keys, causal (``band(queries, keys)``: a sliding
    window's [queries, keys] booleans instead): query [T, heads, dim], key/value [T, groups, dim]
    -> context [T, heads, dim]. One fused call per row (torch's variable-length kernel on a GPU is
    not used yet: it waits for a GPU to be shown on)."""
    bounds = params.cu_seqlens_q.tolist()
    contexts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, heads, n, dim]
        mask = None if band is None else band(end - start, end - start)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=band is None, scale=scale,
                                                 enable_gqa=True)
        contexts.append(context[0].transpose(0, 1))
    return torch.cat(contexts)
