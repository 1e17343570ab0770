"""The generation engine's KV cache and the attention that reads it.

Every decode slot owns a region of ``length`` positions in each layer of this rank's stage; a row
admitted to a slot writes its keys and values at its own positions 0, 1, ... of that region, so
rows of any prompt length share a step. One engine step feeds a packed sequence [1, T]: the whole
prompt of each newly admitted row (its prefill), then one token per decoding row. The attention
of each megatron layer is replaced for the step by :func:`attend`: megatron's own QKV projection,
RoPE at each token's own position, the cache write, causal attention within each prompt, attention
of each decode token over its slot's positions so far, megatron's own output projection.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F


class SlotKVCache:
    """Keys and values [layers, slots, kv_heads, length, head_dim] of this rank's stage (kv_heads
    of this TP rank), in one allocation (2x that), so that the ledger counts it as one kind and
    releasing it frees all of it."""

    def __init__(self, layers: int, slots: int, length: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        # Zeroed: attention reads whole regions with the unwritten positions masked, and a masked
        # NaN would still poison the softmax's weighted sum (0 x NaN).
        self.storage = torch.zeros(2, layers, slots, kv_heads, length, head_dim, dtype=dtype, device=device)
        self.slots, self.length = slots, length

    @property
    def keys(self) -> torch.Tensor:
        return self.storage[0]

    @property
    def values(self) -> torch.Tensor:
        return self.storage[1]

    @property
    def nbytes(self) -> int:
        return self.storage.untyped_storage().nbytes()

    def release(self) -> None:
        self.storage.untyped_storage().resize_(0)


@dataclasses.dataclass
class StepLayout:
    """Where each token of one packed step [1, T] belongs.

    positions, slots: [T] (device) each token's position in its row and its slot.
    prefill: (start, length) of each admitted prompt in the packed sequence (host ints).
    decode_start: where the decode tokens begin; decode_slots: their slots [D] (device);
    decode_span: (first, end) when the decode slots are exactly first..end-1 in order (the cache
    is then read as a view), else None; decode_extent: the longest decode row so far (host).
    rope: [T, 1, 1, dim] rotary angles at ``positions``.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    prefill: List[Tuple[int, int]]
    decode_start: int
    decode_slots: Optional[torch.Tensor]
    decode_span: Optional[Tuple[int, int]]
    decode_extent: int
    rope: Optional[torch.Tensor] = None


def attend(attention: torch.nn.Module, layer: int, cache: SlotKVCache, step: StepLayout,
           hidden_states: torch.Tensor, *args, **kwargs):
    """Stands in for megatron's ``SelfAttention.forward`` during an engine step: hidden [T, 1, h]
    -> (output [T, 1, h], bias). The arguments megatron passes for its own caches are ignored."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    query, key, value = attention.get_query_key_value_tensors(hidden_states, None)  # [T, 1, heads, dim]
    config = attention.config
    query = apply_rotary_pos_emb(query, step.rope, config=config)
    key = apply_rotary_pos_emb(key, step.rope, config=config)
    keys, values = cache.keys[layer], cache.values[layer]  # [slots, kv_heads, length, dim]
    keys[step.slots, :, step.positions] = key[:, 0]
    values[step.slots, :, step.positions] = value[:, 0]
    scale = getattr(attention.core_attention, "softmax_scale", None)
    # A sliding window (megatron's (left, 0)): a token sees itself and the `left` positions before it.
    left = config.window_size[0] if config.window_size else None
    out = torch.empty_like(query)
    for start, n in step.prefill:  # a prompt attends to itself only: its row's positions start at 0
        q, k, v = (t[start : start + n, 0].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        mask = None if left is None else _visible(torch.arange(n, device=q.device), n, left)
        out[start : start + n, 0] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    if step.decode_slots is not None:
        first = step.decode_start
        extent = step.decode_extent
        if step.decode_span is not None:
            lo, hi = step.decode_span
            k, v = keys[lo:hi, :, :extent], values[lo:hi, :, :extent]
        else:
            k, v = keys[step.decode_slots, :, :extent], values[step.decode_slots, :, :extent]
        q = query[first:, 0].unsqueeze(2)  # [D, heads, 1, dim]
        visible = _visible(step.positions[first:], extent, left)
        out[first:, 0] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=True).squeeze(2)
    return attention.linear_proj(out.view(out.shape[0], 1, -1))


def _visible(positions: torch.Tensor, extent: int, left: Optional[int]) -> torch.Tensor:
    """[len(positions), extent]: which cache positions each query position attends to (causal,
    within ``left`` positions before it when a sliding window is set)."""
    keys = torch.arange(extent, device=positions.device)
    distance = positions.unsqueeze(1) - keys
    return (distance >= 0) if left is None else (distance >= 0) & (distance <= left)
