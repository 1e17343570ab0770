"""The full (TP=1, PP=1) state dict of a model <-> one rank's shard under any TP/PP layout.

Pure tensor code (no process groups): checkpoint converters, resharding and the equivalence tests
use the same functions. Keys are those of megatron's GPTModel with local layers
(``decoder.layers.{i}.self_attention.linear_qkv.weight``, ...); full dicts use global layer numbers
and the true (unpadded) vocabulary, shards use local layer numbers and the padded vocabulary.

How each weight is split across TP ranks:
- column-parallel (output rows split): linear_qkv's weight and bias (Megatron orders rows per
  query group: that group's query heads, then its key, then its value head, so contiguous chunks
  are whole groups), word embeddings and output_layer (vocabulary rows);
- linear_fc1 holds [gate; up] stacked: each rank holds [gate_r; up_r];
- row-parallel (input columns split): linear_proj, linear_fc2;
- replicated: norms (q/k norms included: they act on one head), a MoE layer's router and the
  scalar head;
- LoRA adapters: a column-parallel linear's ``lora_b`` as its weight, a row-parallel one's
  ``lora_a`` as its weight; their other factor replicated.

Experts (``decoder.layers.i.mlp.experts.local_experts.e.*``) are split over TP as the dense MLP
is; full dicts and the (TP, PP) shards of a checkpoint hold every expert under its global number e,
and :func:`experts_of_rank` / :func:`experts_renumbered` cut and renumber them for an EP rank,
which holds experts [ep_rank * E / EP, (ep_rank + 1) * E / EP) as 0, 1, ... (megatron's order).

A tied model (``tied=True``: the LM head is the input embedding) has no output_layer in the full
dict; under PP the last stage holds its own copy of the embedding as output_layer (megatron keeps
the two equal by all-reducing their gradients), cut from the embedding here and dropped on merge.
"""

from __future__ import annotations

import re
from typing import Dict, List, Set, Tuple

import torch

from megatron_rlhf.config.schema import stage_layers

StateDict = Dict[str, torch.Tensor]

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# LoRA adapters (models/lora.py) follow their linear: a column-parallel one's B is split as its
# weight, a row-parallel one's A as its weight; the other factor is replicated.
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "self_attention.linear_qkv.lora_b")
# The dense MLP's and each expert's (mlp.experts.local_experts.e.linear_fc1.weight) alike.
_ROW = ("self_attention.linear_proj.weight", "linear_fc2.weight", "self_attention.linear_proj.lora_a",
        "linear_fc2.lora_a")
_GATED = ("linear_fc1.weight", "linear_fc1.lora_b")
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
# transformer-engine fuses each norm into the following linear layer.
_TE_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def to_local_layer_names(state_dict: StateDict) -> StateDict:
    """Translate transformer-engine key names to the local-layer names used here."""
    out = {}
    for key, value in state_dict.items():
        if key.endswith("._extra_state"):
            continue
        for te_name, local_name in _TE_NORM_NAMES.items():
            if key.endswith(te_name):
                key = key[: -len(te_name)] + local_name
        out[key] = value
    return out


def to_te_layer_names(state_dict: StateDict, te_keys: Set[str]) -> StateDict:
    """The inverse of :func:`to_local_layer_names` for a model whose keys are ``te_keys`` (a layer
    with experts keeps its own pre-MLP norm: there is no single linear_fc1 to fuse it into)."""
    out = {}
    for key, value in state_dict.items():
        for te_name, local_name in _TE_NORM_NAMES.items():
            fused = key[: -len(local_name)] + te_name
            if key.endswith(local_name) and key.startswith("decoder.layers.") and fused in te_keys:
                key = fused
        out[key] = value
    return out


def _vocab_keys(head: str) -> tuple:
    # The scalar head takes output_layer's place but is replicated, with no vocabulary rows.
    if head not in ("lm", "scalar"):
        raise ValueError(f"head must be 'lm' or 'scalar', got {head!r}")
    return _VOCAB if head == "lm" else _VOCAB[:1]


def _split(name: str, tensor: torch.Tensor, tp_size: int, tp_rank: int, vocab: tuple) -> torch.Tensor:
    if name.endswith(_COLUMN) or name in vocab:
        return tensor.chunk(tp_size, dim=0)[tp_rank]
    if name.endswith(_ROW):
        return tensor.chunk(tp_size, dim=1)[tp_rank]
    if name.endswith(_GATED):
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    return tensor


def _join(name: str, shards: List[torch.Tensor], vocab: tuple) -> torch.Tensor:
    if name.endswith(_COLUMN) or name in vocab:
        return torch.cat(shards, dim=0)
    if name.endswith(_ROW):
        return torch.cat(shards, dim=1)
    if name.endswith(_GATED):
        pairs = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs], dim=0)
    for other in shards[1:]:
        if not torch.equal(other, shards[0]):
            raise ValueError(f"{name}: replicated tensor differs between TP ranks")
    return shards[0]


def _pad_vocab(tensor: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    if tensor.shape[0] > padded_vocab:
        raise ValueError(f"vocabulary of {tensor.shape[0]} rows exceeds padded size {padded_vocab}")
    if tensor.shape[0] == padded_vocab:
        return tensor
    pad = tensor.new_zeros((padded_vocab - tensor.shape[0],) + tuple(tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


def shard_state_dict(
    full: StateDict,
    num_layers: int,
    padded_vocab: int,
    tp_size: int,
    tp_rank: int,
    pp_size: int = 1,
    pp_rank: int = 0,
    head: str = "lm",
    tied: bool = False,
) -> StateDict:
    """This rank's state dict (local layer numbers, padded vocabulary) from the full one (or any
    part of it: keys this rank does not hold are skipped)."""
    vocab = _vocab_keys(head)
    layers = stage_layers(num_layers, pp_size, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: StateDict = {}
    for key, tensor in full.items():
        match = _LAYER_KEY.match(key)
        if match:
            layer, rest = int(match.group(1)), match.group(2)
            if layer not in layers:
                continue
            local_key = f"decoder.layers.{layer - layers.start}.{rest}"
            out[local_key] = _split(rest, tensor, tp_size, tp_rank, vocab).clone()
            continue
        if key == _VOCAB[0] and tied and last and not first:
            out[_VOCAB[1]] = _split(_VOCAB[1], _pad_vocab(tensor, padded_vocab), tp_size, tp_rank, vocab).clone()
        if key.startswith("embedding.") and not first:
            continue
        if (key.startswith("output_layer.") or key.startswith("decoder.final_layernorm.")) and not last:
            continue
        if key in vocab:
            tensor = _pad_vocab(tensor, padded_vocab)
        out[key] = _split(key, tensor, tp_size, tp_rank, vocab).clone()
    return out


def merge_state_dicts(
    shards: List[List[StateDict]], num_layers: int, vocab_size: int, head: str = "lm", tied: bool = False
) -> StateDict:
    """The full state dict from ``shards[pp_rank][tp_rank]``; vocabulary padding (and a tied
    model's copy of the embedding on the last stage) is dropped."""
    vocab = _vocab_keys(head)
    pp_size, tp_size = len(shards), len(shards[0])
    full: StateDict = {}
    for pp_rank, stage in enumerate(shards):
        layers = stage_layers(num_layers, pp_size, pp_rank)
        for key in stage[0]:
            if tied and key == _VOCAB[1]:
                continue
            pieces = [stage[tp][key] for tp in range(tp_size)]
            match = _LAYER_KEY.match(key)
            if match:
                rest = match.group(2)
                global_key = f"decoder.layers.{int(match.group(1)) + layers.start}.{rest}"
                full[global_key] = _join(rest, pieces, vocab)
            else:
                tensor = _join(key, pieces, vocab)
                if key in vocab:
                    tensor = tensor[:vocab_size]
                full[key] = tensor
    return full


def stages_of(key: str, num_layers: int, pp_size: int, tied: bool = False) -> Tuple[int, ...]:
    """The pipeline stages that need full-state-dict key ``key`` (a tied model's embedding: the
    first and, as its output layer, the last)."""
    match = _LAYER_KEY.match(key)
    if match:
        layer = int(match.group(1))
        return tuple(r for r in range(pp_size) if layer in stage_layers(num_layers, pp_size, r))
    if key.startswith("embedding."):
        return (0, pp_size - 1) if tied and key == _VOCAB[0] and pp_size > 1 else (0,)
    return (pp_size - 1,)


def experts_of_rank(state: StateDict, num_experts: int, ep_size: int, ep_rank: int) -> StateDict:
    """An EP rank's part of ``state``: its experts, renumbered from 0, and every other tensor."""
    per_rank = num_experts // ep_size
    out: StateDict = {}
    for key, tensor in state.items():
        match = _EXPERT.match(key)
        if match is None:
            out[key] = tensor
            continue
        local = int(match.group(2)) - ep_rank * per_rank
        if 0 <= local < per_rank:
            out[f"{match.group(1)}{local}{match.group(3)}"] = tensor
    return out


def experts_renumbered(state: StateDict, num_experts: int, ep_size: int, ep_rank: int) -> StateDict:
    """The inverse of :func:`experts_of_rank` for the experts: local numbers back to global ones."""
    offset = ep_rank * (num_experts // ep_size)
    out: StateDict = {}
    for key, tensor in state.items():
        match = _EXPERT.match(key)
        out[f"{match.group(1)}{int(match.group(2)) + offset}{match.group(3)}" if match else key] = tensor
    return out


def merge_tensor(key: str, tp_pieces: List[torch.Tensor], vocab_size: int, head: str = "lm") -> torch.Tensor:
    """One full tensor (vocabulary padding dropped) from its TP pieces; ``key`` full or local."""
    vocab = _vocab_keys(head)
    match = _LAYER_KEY.match(key)
    tensor = _join(match.group(2) if match else key, tp_pieces, vocab)
    return tensor[:vocab_size] if key in vocab else tensor
