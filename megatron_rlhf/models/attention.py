"""Core attention on torch's fused kernels, where transformer-engine is absent.

megatron-core's local ``DotProductAttention`` materialises the scores [b, heads, s, s] with an
explicit causal mask and an unfused softmax. :class:`FusedCoreAttention` takes its place in the
local layer specs and computes the same attention with ``scaled_dot_product_attention`` (flash or
memory-efficient kernels on a GPU, the flash kernel on CPU): causal without a mask tensor,
grouped-query heads without copying keys and values, the softmax scale megatron chose for the
layer, and a sliding window as one [s, s] boolean band for every row and head. Rows are
right-padded (models/batches.py), so causal attention keeps padding from ever reaching a real
token: no per-row mask is needed.

Under context parallelism (config.context_parallel_size > 1, which megatron's local attention
refuses) each rank holds two chunks of every row and attends over the CP group's gathered keys and
values (models/context_parallel.py). Packed rows (megatron's ``thd`` packed-sequence parameters,
which its local attention refuses too) attend each within its own row (models/packed_rows.py).

The role key ``attention`` chooses it (``fused``, the default) or megatron's own (``local``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_rlhf.models import batch_invariant, context_parallel, packed_rows


class FusedCoreAttention(DotProductAttention):
    """megatron's core attention (the same constructor: heads per TP rank, softmax scale, window),
    on ``scaled_dot_product_attention``. query [sq, b, heads, dim], key/value [sk, b, groups, dim]
    -> context [sq, b, heads x dim]."""

    def __init__(self, config, layer_number, *args, pg_collection=None, **kwargs):
        # megatron's own asserts CP = 1 (only transformer-engine's divides a sequence); this one does.
        alone = copy.copy(config)
        alone.context_parallel_size = 1
        super().__init__(alone, layer_number, *args, pg_collection=pg_collection, **kwargs)
        self.config = config
        self.cp_group = None
        if config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self.cp_group = pg_collection.cp if pg_collection is not None else parallel_state.get_context_parallel_group()
        if self.softmax_offset is not None:  # megatron's off-by-one and learnable softmax types
            raise ValueError(f"attention: fused computes the plain softmax, not softmax_type {config.softmax_type!r}")
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.window = config.window_size if windowed else None  # (tokens before, tokens after)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention: fused takes no attention bias (megatron's local attention refuses it too)")
        if packed_seq_params is not None:
            return self._packed(query, key, value, attention_mask, packed_seq_params)
        if batch_invariant.enabled():
            return self._batch_invariant(query, key, value, attention_mask)
        if self.cp_group is not None:
            if attention_mask is not None:
                raise ValueError("context parallelism: causal attention over right-padded rows only, not an attention mask")
            context = context_parallel.attention(query, key, value, self.cp_group, self.softmax_scale,
                                                 self._band(query.device))
            return context.reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        if attention_mask is not None:  # megatron's convention: True = masked out
            mask, causal = ~attention_mask, False
        elif self.window is not None:
            mask, causal = window_band(q.shape[2], k.shape[2], self.window, q.device), False
        else:
            mask, causal = None, True
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                 scale=self.softmax_scale, enable_gqa=True)
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

    def _band(self, device):
        """The sliding window's band for (queries, keys) as context_parallel and packed_rows call it; None: causal."""
        return None if self.window is None else (lambda sq, sk: window_band(sq, sk, self.window, device))

    def _packed(self, query, key, value, attention_mask, params):
        """Packed rows ([T, heads, dim]: megatron squeezed the batch of one) each over its own keys."""
        if params.qkv_format != "thd" or attention_mask is not None or self.cp_group is not None \
                or batch_invariant.enabled():
            raise ValueError("attention: packed rows are causal rows laid end to end (thd) without an attention mask, "
                             "context parallelism or the batch-invariant mode")
        context = packed_rows.attention(query, key, value, params, self.softmax_scale, self._band(query.device))
        return context.reshape(query.shape[0], self.hidden_size_per_partition)

    def _batch_invariant(self, query, key, value, attention_mask):
        """Each query over the mode's key blocks (models/batch_invariant.py), as the engine's."""
        if attention_mask is not None:
            raise ValueError("trainer.batch_invariant: causal attention over right-padded rows only, not an attention mask")
        sq, b, heads, dim = query.shape
        sk = key.shape[0]
        rows = torch.arange(b, device=query.device).repeat_interleave(sq)
        positions = torch.arange(sk - sq, sk, device=query.device).repeat(b)
        pad = (0, 0, 0, batch_invariant.whole_blocks(sk) - sk)  # whole key blocks, padded once here
        keys, values = (F.pad(t.permute(1, 2, 0, 3), pad) for t in (key, value))  # [b, groups, whole key blocks, dim]
        context = batch_invariant.attention(query.transpose(0, 1).reshape(b * sq, heads, dim), keys, values, rows,
                                            positions, self.softmax_scale, self.window)
        return context.view(b, sq, heads * dim).transpose(0, 1).contiguous()


def window_band(sq: int, sk: int, window, device) -> torch.Tensor:
    """[sq, sk] True where query i may read key j under megatron's ``window`` (tokens before,
    tokens after): j - i' at most the tokens after and i' - j at most the tokens before, i' = i + sk - sq.
    Made per call (s x s booleans, one for every row and head): a kept copy would stay on the device
    outside what EMS and the ledger count."""
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return (j <= i + window[1]) & (i - j <= window[0])


def with_core_attention(spec, attention: str):
    """``spec`` (a layer's ModuleSpec, or a block's TransformerBlockSubmodules) with megatron's
    local core attention replaced by :class:`FusedCoreAttention` when ``attention`` is fused."""
    if attention == "local":
        return spec
    if attention != "fused":
        raise ValueError(f"attention must be 'fused' or 'local', got {attention!r}")
    for layer in getattr(spec, "layer_specs", [spec]):
        self_attention = layer.submodules.self_attention.submodules
        if self_attention.core_attention is DotProductAttention:
            self_attention.core_attention = FusedCoreAttention
    return spec

