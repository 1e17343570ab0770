"""The generation engine's KV cache and the attention that reads it.

Every decode slot owns a region of ``length`` positions in each layer of this rank's stage; a row
admitted to a slot writes its keys and values at its own positions 0, 1, ... of that region, so
rows of any prompt length share a step. The attention of each megatron layer is replaced for an
engine step (packing.py) by :func:`attend`: megatron's own QKV projection (and q/k norms), RoPE at
each token's own position, the cache write, causal attention within each prompt (prompts of one
length in one call; a prompt fed after cached positions attends to them too), attention of each
decode token over its slot's positions so far (one call over a view of the cache), megatron's own
output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rlhf.generation.packing import PrefillGroup, StepLayout
from megatron_rlhf.models import batch_invariant


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


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's (non-interleaved) RoPE: t [T, 1, heads, dim] rotated on its first cos.shape[-1]
    dimensions by the factors [T, 1, 1, rotary dim]."""
    rotary = cos.shape[-1]
    x = t[..., :rotary]
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if rotary == t.shape[-1] else torch.cat((out, t[..., rotary:]), dim=-1)


def attend(attention: torch.nn.Module, layer: int, cache: SlotKVCache, step: StepLayout,
           hidden_states: torch.Tensor, *args, **kwargs):
    """Stands in for megatron's ``SelfAttention.forward`` during an engine step: hidden [T, 1, h]
    -> (output [T, 1, h], bias). The arguments megatron passes for its own caches are ignored."""
    query, key, value = attention.get_query_key_value_tensors(hidden_states, None)  # [T, 1, heads, dim]
    query, key = rotate(query, step.cos, step.sin), rotate(key, step.cos, step.sin)
    keys, values = cache.keys[layer], cache.values[layer]  # [slots, kv_heads, length, dim]
    keys[step.slots, :, step.positions] = key[:, 0]
    values[step.slots, :, step.positions] = value[:, 0]
    scale = getattr(attention.core_attention, "softmax_scale", None)
    if batch_invariant.enabled():  # every token over its slot's keys, as the trainer's forward
        window = None if step.window is None else (step.window, 0)
        # A decode step's rows are slots 0..R-1 (a row not decoding reads its slot and is dropped).
        key_rows = None if step.decode_span == (0, query.shape[0]) and not step.prefill else step.slots
        out = batch_invariant.attention(query[:, 0], keys, values, key_rows, step.positions,
                                        query.shape[-1] ** -0.5 if scale is None else scale, window)
        return attention.linear_proj(out.view(out.shape[0], 1, -1))
    out = torch.empty_like(query)
    for group in step.prefill:
        if group.offset:  # after cached positions: the keys and values come from the cache
            _prefill_after(query[:, 0], keys, values, group, scale, out[:, 0])
        else:
            _prefill(query[:, 0], key[:, 0], value[:, 0], group, scale, out[:, 0])
    if step.decodes:
        out[step.decode_start :, 0] = _decode(query[step.decode_start :, 0], keys, values, step, scale)
    return attention.linear_proj(out.view(out.shape[0], 1, -1))


def _prefill(query, key, value, group: PrefillGroup, scale, out) -> None:
    """Causal attention of each prompt of ``group`` to itself: q/k/v/out [T, heads, dim]."""
    if group.span is not None:
        start, n = group.span
        q, k, v = (t[start : start + n].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    else:
        q, k, v = (t[group.index].transpose(1, 2) for t in (query, key, value))  # [G, heads, n, dim]
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, is_causal=group.mask is None, scale=scale,
                                              enable_gqa=True).transpose(1, 2)  # [G, n, heads, dim]
    if group.span is not None:
        out[start : start + n] = attended[0]
    else:
        out[group.index] = attended


def _prefill_after(query, keys, values, group: PrefillGroup, scale, out) -> None:
    """Attention of each prompt of ``group`` (queries [T, heads, dim]) over its slot's cached
    positions and itself (already written to the cache), causal within the prompt."""
    extent = group.offset + group.index.shape[1]
    q = query[group.index].transpose(1, 2)  # [G, heads, n, dim]
    k, v = keys[group.slots, :, :extent], values[group.slots, :, :extent]  # [G, kv_heads, extent, dim]
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=True)
    out[group.index] = attended.transpose(1, 2)


def _decode(query, keys, values, step: StepLayout, scale) -> torch.Tensor:
    """Attention of each decode token [D, heads, dim] over its slot's positions so far: over the
    slots decode_span covers (a view of the cache), or, when the decoding slots are at most half of
    that span, over theirs gathered. Two batched matmuls rather than SDPA: at one query per slot
    its per-call set-up costs more than the arithmetic."""
    lo, hi = step.decode_span
    extent = step.decode_bias.shape[-1]
    if 2 * query.shape[0] <= hi - lo:  # few decoding slots in a wide span (turns joining): only theirs read
        slots = step.slots[step.decode_start :]
        q, bias, picked = query, step.decode_bias[step.decode_rows], None
        keys, values = keys[slots, :, :extent], values[slots, :, :extent]  # gathered: a copy of theirs only
    else:  # a view of the span; a slot not decoding computes a row that is dropped
        every_slot = query.shape[0] == hi - lo  # then the decode slots are lo..hi-1 in order
        q = query if every_slot else query.new_zeros(hi - lo, *query.shape[1:]).index_copy_(0, step.decode_rows, query)
        keys, values = keys[lo:hi, :, :extent], values[lo:hi, :, :extent]
        bias, picked = step.decode_bias, None if every_slot else step.decode_rows
    rows, kv_heads = q.shape[0], keys.shape[1]
    q = q.view(rows, kv_heads, -1, q.shape[-1])  # [rows, kv_heads, queries per kv head, dim]
    scores = torch.matmul(q, keys.transpose(-1, -2))
    scores = scores.mul_(q.shape[-1] ** -0.5 if scale is None else scale).add_(bias)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    attended = torch.matmul(probs, values).view(rows, -1, q.shape[-1])
    return attended if picked is None else attended.index_select(0, picked)
