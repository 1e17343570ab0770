"""Hugging Face decoders of the Llama line (config/families.py) <-> the full Megatron state dict of
models/sharding.py, one tensor at a time. Pure tensor code. Every family here uses the same
tensor names; the architecture's features decide which exist.

Names (layer i):
  model.embed_tokens.weight                      embedding.word_embeddings.weight
  model.layers.i.input_layernorm.weight          decoder.layers.i.input_layernorm.weight
  model.layers.i.self_attn.{q,k,v}_proj.weight   decoder.layers.i.self_attention.linear_qkv.weight
  model.layers.i.self_attn.{q,k,v}_proj.bias     decoder.layers.i.self_attention.linear_qkv.bias (qkv_bias)
  model.layers.i.self_attn.{q,k}_norm.weight     decoder.layers.i.self_attention.{q,k}_layernorm.weight (qk_norm)
  model.layers.i.self_attn.o_proj.weight         decoder.layers.i.self_attention.linear_proj.weight
  model.layers.i.post_attention_layernorm.weight decoder.layers.i.pre_mlp_layernorm.weight
  model.layers.i.mlp.{gate,up}_proj.weight       decoder.layers.i.mlp.linear_fc1.weight  ([gate; up])
  model.layers.i.mlp.down_proj.weight            decoder.layers.i.mlp.linear_fc2.weight
  model.layers.i.{B}.{R}.weight                  decoder.layers.i.mlp.router.weight            (a layer with experts)
  model.layers.i.{B}.experts.e.{gate,up}.weight  decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight
  model.layers.i.{B}.experts.e.{down}.weight     decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight
  model.layers.i.{B}.{S}.{gate,up}.weight        decoder.layers.i.mlp.shared_experts.linear_fc1.weight (a shared expert)
  model.layers.i.{B}.{S}.{down}.weight           decoder.layers.i.mlp.shared_experts.linear_fc2.weight
  model.layers.i.{B}.{S}_gate.weight             decoder.layers.i.mlp.shared_experts.gate_weight
  model.norm.weight                              decoder.final_layernorm.weight
  lm_head.weight (LM) | score.weight (reward)    output_layer.weight (none for a tied LM: the embedding)

B, R, S and the expert projections' names are the family's (families.ExpertNames: Qwen3-MoE's
mlp.gate and {gate,up,down}_proj, Mixtral's block_sparse_moe.gate and w1, w3, w2, Qwen2-MoE's shared
expert mlp.shared_expert); e counts every
expert of the layer (the full dict holds them all; models/sharding.py cuts them per EP rank).

Megatron's fused QKV orders rows (and bias entries) by query group: the group's query heads, its
key head, its value head. Both use the same (non-interleaved, rotate-half) rotary layout, so no
permutation is needed.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_rlhf.config.families import ExpertNames, family_of
from megatron_rlhf.config.schema import ModelArchConfig

GetTensor = Callable[[str], torch.Tensor]

# A layer's linears (config.names.LORA_TARGETS): each one's module (after decoder.layers.i.) and the
# Hugging Face projections it holds (after model.layers.i.), in the order of its rows' blocks.
LINEARS = {
    "linear_qkv": ("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "linear_proj": ("self_attention.linear_proj", ("self_attn.o_proj",)),
    "linear_fc1": ("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj")),
    "linear_fc2": ("mlp.linear_fc2", ("mlp.down_proj",)),
}
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    **{f"{LINEARS[linear][0]}.weight": f"{LINEARS[linear][1][0]}.weight" for linear in ("linear_proj", "linear_fc2")},
}
_QKV = {"self_attention.linear_qkv.weight": "weight", "self_attention.linear_qkv.bias": "bias"}
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_KEY = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_ROUTER = "mlp.router.weight"
_SHARED = ("mlp.shared_experts.gate_weight", "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight")
# Tensors older checkpoints carry that are derived, not learnt (RoPE frequencies).
DERIVED_HF_TENSORS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def head_key(head: str) -> str:
    return "lm_head.weight" if head == "lm" else "score.weight"


def layer_keys(arch: ModelArchConfig, has_experts: bool = False) -> List[str]:
    """The Megatron keys of one transformer layer (after ``decoder.layers.i.``), in module order."""
    keys = ["input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight"]
    if arch.qkv_bias:
        keys.append("self_attention.linear_qkv.bias")
    if arch.qk_norm:
        keys += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    if not has_experts:
        return keys + ["pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    experts = [f"mlp.experts.local_experts.{e}.{fc}.weight" for e in range(arch.num_experts) for fc in ("linear_fc1", "linear_fc2")]
    shared = list(_SHARED) if arch.moe_shared_expert_ffn_hidden_size else []
    return keys + ["pre_mlp_layernorm.weight", _ROUTER] + experts + shared


def megatron_keys(arch: ModelArchConfig, head: str) -> List[str]:
    """Every key of the full Megatron state dict, in order."""
    keys = ["embedding.word_embeddings.weight"]
    for i, has_experts in enumerate(arch.moe_layers()):
        keys += [f"decoder.layers.{i}.{k}" for k in layer_keys(arch, has_experts)]
    return keys + ["decoder.final_layernorm.weight"] + ([] if arch.tied_output(head) else ["output_layer.weight"])


def expected_hf_shapes(arch: ModelArchConfig, head: str) -> Dict[str, Tuple[int, ...]]:
    """The tensors (and shapes) a Hugging Face checkpoint of this architecture must hold."""
    h, ffn, hd = arch.hidden_size, arch.ffn_hidden_size, arch.kv_channels
    q, kv = arch.num_attention_heads * hd, arch.kv_groups * hd
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tied_output(head):
        shapes[head_key(head)] = (arch.vocab_size, h) if head == "lm" else (1, h)
    for i, has_experts in enumerate(arch.moe_layers()):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        })
        if has_experts:
            for key in layer_keys(arch, has_experts=True):
                width = arch.moe_shared_expert_ffn_hidden_size if key in _SHARED else arch.moe_ffn_hidden_size
                shape = ((arch.num_experts, h) if key == _ROUTER else (1, h) if key == _SHARED[0]
                         else (h, width) if key.endswith("fc2.weight") else (width, h))
                shapes.update((name, shape) for name in _moe_hf_names(arch, p, key) or ())
        else:
            shapes.update({p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                           p + "mlp.down_proj.weight": (h, ffn)})
        if arch.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if arch.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def _moe_hf_names(arch: ModelArchConfig, p: str, rest: str) -> Optional[List[str]]:
    """The HF tensors behind a MoE layer's Megatron key ``rest`` (layer prefix ``p``): the router,
    an expert's (or the shared expert's) [gate; up] pair or its down projection, the shared expert's
    gate; None for any other key."""
    expert = _EXPERT_KEY.match(rest)
    if rest != _ROUTER and expert is None and rest not in _SHARED:
        return None
    names: Optional[ExpertNames] = family_of(arch.family).experts
    if names is None or (rest in _SHARED and names.shared is None):
        raise ValueError(f"family {arch.family!r} has no {'shared expert' if rest in _SHARED else 'experts'}, "
                         f"but the model has {rest}")
    if rest == _ROUTER:
        return [p + f"{names.block}.{names.router}.weight"]
    if rest == _SHARED[0]:
        return [p + f"{names.block}.{names.shared}_gate.weight"]
    fc = "linear_fc1" if rest.endswith("linear_fc1.weight") else "linear_fc2"
    x = p + (f"{names.block}.{names.shared}." if rest in _SHARED else f"{names.block}.experts.{expert.group(1)}.")
    return [x + f"{names.down}.weight"] if fc == "linear_fc2" else [x + f"{names.gate}.weight", x + f"{names.up}.weight"]


def _qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArchConfig) -> torch.Tensor:
    groups, hd = arch.kv_groups, arch.kv_channels
    per_group = arch.num_attention_heads // groups
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(groups, per_group * hd, *tail)
    k, v = k.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _qkv_to_hf(qkv: torch.Tensor, arch: ModelArchConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, hd = arch.kv_groups, arch.kv_channels
    per_group = arch.num_attention_heads // groups
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * hd, *tail)
    q, k, v = grouped.split([per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def megatron_tensor(key: str, get: GetTensor, arch: ModelArchConfig, head: str) -> torch.Tensor:
    """One tensor of the full Megatron state dict, read from the HF checkpoint through ``get``."""
    if key == "embedding.word_embeddings.weight":
        return get("model.embed_tokens.weight")
    if key == "decoder.final_layernorm.weight":
        return get("model.norm.weight")
    if key == "output_layer.weight":
        return get(head_key(head))
    layer, rest = _LAYER_KEY.match(key).groups()
    p = f"model.layers.{layer}."
    if rest in _LAYER_SIMPLE:
        return get(p + _LAYER_SIMPLE[rest])
    if rest in _QKV:
        kind = _QKV[rest]
        return _qkv_from_hf(*(get(p + f"self_attn.{n}_proj.{kind}") for n in "qkv"), arch)
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
    moe = _moe_hf_names(arch, p, rest)
    if moe is not None:
        return get(moe[0]) if len(moe) == 1 else torch.cat([get(name) for name in moe])
    raise KeyError(key)


def hf_tensors(key: str, tensor: torch.Tensor, arch: ModelArchConfig, head: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """The HF tensors that one full Megatron tensor becomes."""
    if key == "embedding.word_embeddings.weight":
        yield "model.embed_tokens.weight", tensor
    elif key == "decoder.final_layernorm.weight":
        yield "model.norm.weight", tensor
    elif key == "output_layer.weight":
        yield head_key(head), tensor
    else:
        layer, rest = _LAYER_KEY.match(key).groups()
        p = f"model.layers.{layer}."
        if rest in _LAYER_SIMPLE:
            yield p + _LAYER_SIMPLE[rest], tensor
        elif rest in _QKV:
            for name, part in zip("qkv", _qkv_to_hf(tensor, arch)):
                yield p + f"self_attn.{name}_proj.{_QKV[rest]}", part.contiguous()
        elif rest == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2)
            yield p + "mlp.gate_proj.weight", gate.contiguous()
            yield p + "mlp.up_proj.weight", up.contiguous()
        elif (names := _moe_hf_names(arch, p, rest)) is not None:
            for name, part in zip(names, tensor.chunk(len(names))):  # [gate; up] for an expert's fc1
                yield name, part.contiguous()
        else:
            raise KeyError(key)
