"""megatron's unfused RoPE (rope_utils._apply_rotary_pos_emb_bshd) with the same arithmetic and
less work: the cosines and sines of one angle tensor computed once (megatron computes them again
for the queries and the keys of every layer; its rotary embedding hands every layer the same
angles, cached by length), and no copy of the rotated tensor onto an empty unrotated part. The
results are bitwise megatron's (tests/test_models.py); interleaved and multi-latent RoPE go to
megatron's own. The latest angles' cosines and sines stay until other angles come: [s, 1, 1, rot]
each, beside megatron's own cache of the angles by length.

Under context parallelism megatron's rotary embedding keeps the angles of the CP rank's two chunks
(rope_utils.get_pos_emb_on_this_cp_rank), building their index with ``.cuda()``: the same selection
is made here on the angles' own device, so that CP runs on CPU too."""

from __future__ import annotations

import weakref
from typing import Dict, Tuple

import torch

from megatron_rlhf.runtime.megatron_compat.sites import Site

# What each function here relies on (name -> sites), checked at start-up (megatron_compat.check).
ANCHORS: Dict[str, Tuple[Site, ...]] = {
    "rope_applied": (
        Site("models/common/embeddings/rope_utils.py", "def _apply_rotary_pos_emb_bshd("),
        Site("models/common/embeddings/rope_utils.py", "cos_ = (torch.cos(freqs) * mscale).to(t.dtype)"),
        Site("models/common/embeddings/rope_utils.py", "t = (t * cos_) + (_rotate_half(t, rotary_interleaved) * sin_)"),
        Site("models/common/embeddings/rope_utils.py", "return torch.cat((t, t_pass), dim=-1)"),
        Site("models/common/embeddings/rope_utils.py", "return _apply_rotary_pos_emb_bshd("),
    ),
    "cp_rank_angles": (
        Site("models/common/embeddings/rotary_pos_embedding.py", "    get_pos_emb_on_this_cp_rank,"),
        Site("models/common/embeddings/rotary_pos_embedding.py", "emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)"),
        Site("models/common/embeddings/rope_utils.py", "[cp_rank, (2 * cp_size - cp_rank - 1)], device=\"cpu\", pin_memory=True"),
    ),
}

_megatrons = None  # megatron's function, for the cases this one does not take
_last: Dict[str, object] = {"angles": lambda: None}  # the latest angles (weakly) and their cosines and sines


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    key = (freqs._version, mscale, dtype)
    if _last["angles"]() is not freqs or _last["key"] != key:
        _last.update(angles=weakref.ref(freqs), key=key, cos=(torch.cos(freqs) * mscale).to(dtype),
                     sin=(torch.sin(freqs) * mscale).to(dtype))
    return _last["cos"], _last["sin"]


def apply_rope_bshd(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                    multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """megatron's _apply_rotary_pos_emb_bshd: t [s, b, heads, dim] rotated by angles [s, 1, 1, rot]."""
    if rotary_interleaved or multi_latent_attention:
        return _megatrons(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    rot_dim = freqs.shape[-1]
    rotated = t if rot_dim == t.shape[-1] else t[..., :rot_dim]
    cos_, sin_ = _cos_sin(freqs, mscale, t.dtype)
    x1, x2 = torch.chunk(rotated, 2, dim=-1)
    out = (rotated * cos_) + (torch.cat((-x2, x1), dim=-1) * sin_)
    return out if rot_dim == t.shape[-1] else torch.cat((out, t[..., rot_dim:]), dim=-1)


def angles_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron's get_pos_emb_on_this_cp_rank with its index on the angles' own device: the angles
    of chunks r and 2CP-1-r of 2 x CP for CP rank r."""
    cp, rank = cp_group.size(), cp_group.rank()
    chunks = torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, chunks)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def bind_rope() -> None:
    """megatron's RoPE callers look the function up in their module at call time: point it here."""
    global _megatrons
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = angles_on_this_cp_rank

    if rope_utils._apply_rotary_pos_emb_bshd is not apply_rope_bshd:
        _megatrons = rope_utils._apply_rotary_pos_emb_bshd
        rope_utils._apply_rotary_pos_emb_bshd = apply_rope_bshd
