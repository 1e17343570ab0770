"""Hugging Face Llama / Llama-2 <-> the full Megatron state dict of models/sharding.py, one tensor
at a time. Pure tensor code.

Names (layer i):
  model.embed_tokens.weight                      embedding.word_embeddings.weight
  model.layers.i.input_layernorm.weight          decoder.layers.i.input_layernorm.weight
  model.layers.i.self_attn.{q,k,v}_proj.weight   decoder.layers.i.self_attention.linear_qkv.weight
  model.layers.i.self_attn.o_proj.weight         decoder.layers.i.self_attention.linear_proj.weight
  model.layers.i.post_attention_layernorm.weight decoder.layers.i.pre_mlp_layernorm.weight
  model.layers.i.mlp.{gate,up}_proj.weight       decoder.layers.i.mlp.linear_fc1.weight  ([gate; up])
  model.layers.i.mlp.down_proj.weight            decoder.layers.i.mlp.linear_fc2.weight
  model.norm.weight                              decoder.final_layernorm.weight
  lm_head.weight (LM) | score.weight (reward)    output_layer.weight

Megatron's fused QKV orders rows by query group: the group's query heads, its key head, its value
head. Both use the same (non-interleaved, rotate-half) rotary layout, so no permutation is needed.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from megatron_rlhf.config.schema import ModelArchConfig

GetTensor = Callable[[str], torch.Tensor]

_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def head_key(head: str) -> str:
    return "lm_head.weight" if head == "lm" else "score.weight"


def megatron_keys(arch: ModelArchConfig) -> List[str]:
    """Every key of the full Megatron state dict, in order."""
    keys = ["embedding.word_embeddings.weight"]
    for i in range(arch.num_layers):
        keys += [
            f"decoder.layers.{i}.input_layernorm.weight",
            f"decoder.layers.{i}.self_attention.linear_qkv.weight",
            f"decoder.layers.{i}.self_attention.linear_proj.weight",
            f"decoder.layers.{i}.pre_mlp_layernorm.weight",
            f"decoder.layers.{i}.mlp.linear_fc1.weight",
            f"decoder.layers.{i}.mlp.linear_fc2.weight",
        ]
    return keys + ["decoder.final_layernorm.weight", "output_layer.weight"]


def expected_hf_shapes(arch: ModelArchConfig, head: str) -> Dict[str, Tuple[int, ...]]:
    """The tensors (and shapes) a Hugging Face checkpoint of this architecture must hold."""
    h, ffn, hd = arch.hidden_size, arch.ffn_hidden_size, arch.hidden_size // arch.num_attention_heads
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    shapes[head_key(head)] = (arch.vocab_size, h) if head == "lm" else (1, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (arch.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": (arch.kv_groups * hd, h),
            p + "self_attn.v_proj.weight": (arch.kv_groups * hd, h),
            p + "self_attn.o_proj.weight": (h, arch.num_attention_heads * hd),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        })
    return shapes


def _qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArchConfig) -> torch.Tensor:
    groups, hd = arch.kv_groups, arch.hidden_size // arch.num_attention_heads
    per_group = arch.num_attention_heads // groups
    q = q.reshape(groups, per_group * hd, -1)
    k, v = k.reshape(groups, hd, -1), v.reshape(groups, hd, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])


def _qkv_to_hf(qkv: torch.Tensor, arch: ModelArchConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, hd = arch.kv_groups, arch.hidden_size // arch.num_attention_heads
    per_group = arch.num_attention_heads // groups
    grouped = qkv.reshape(groups, (per_group + 2) * hd, -1)
    q, k, v = grouped.split([per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, qkv.shape[-1]), k.reshape(-1, qkv.shape[-1]), v.reshape(-1, qkv.shape[-1])


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
    if rest == "self_attention.linear_qkv.weight":
        return _qkv_from_hf(get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight"), get(p + "self_attn.v_proj.weight"), arch)
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
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
        elif rest == "self_attention.linear_qkv.weight":
            for name, part in zip(("q_proj", "k_proj", "v_proj"), _qkv_to_hf(tensor, arch)):
                yield p + f"self_attn.{name}.weight", part.contiguous()
        elif rest == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2)
            yield p + "mlp.gate_proj.weight", gate.contiguous()
            yield p + "mlp.up_proj.weight", up.contiguous()
        else:
            raise KeyError(key)


def arch_from_hf_config(cfg: dict, source: str) -> ModelArchConfig:
    """Our architecture from a Llama config.json (``source`` names the file in errors)."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}; is this a Llama config.json?")
    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"{source}: model_type {model_type!r}; only Llama / Llama-2 checkpoints convert")
    if cfg.get("tie_word_embeddings"):
        raise ValueError(f"{source}: tie_word_embeddings is true; Llama-2 unties the input and output embeddings")
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {}).get("rope_type", "default")
    if scaling not in (None, "default"):
        raise ValueError(f"{source}: rope scaling {scaling!r} is not supported (Llama-2 uses none)")
    return ModelArchConfig(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rotary_base=float(rope),
        norm_epsilon=cfg.get("rms_norm_eps", 1e-5),
    )


def hf_config_from_arch(arch: ModelArchConfig, head: str, dtype: torch.dtype) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM" if head == "lm" else "LlamaForSequenceClassification"],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.kv_groups,
        "num_hidden_layers": arch.num_layers,
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.norm_epsilon,
        "rope_theta": arch.rotary_base,
        "rope_parameters": {"rope_theta": arch.rotary_base, "rope_type": "default"},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    if head == "scalar":
        cfg["num_labels"] = 1
    return cfg
