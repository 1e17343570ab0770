"""The generation engine's seam: megatron's attention layers, replaced for the steps of an engine,
and the RoPE angles, frequencies and attention factor it reads."""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from megatron_rlhf.runtime.megatron_compat.sites import Site, methods_replaced

# What each function here relies on (name -> sites), checked at start-up (megatron_compat.check).
ANCHORS: Dict[str, Tuple[Site, ...]] = {
    "engine_attention": (
        Site("transformer/transformer_layer.py", "attention_output_with_bias = self.self_attention("),
        Site("transformer/attention.py", "def get_query_key_value_tensors("),
        Site("transformer/attention.py", "output, bias = self.linear_proj(core_attn_out)"),
        Site("transformer/transformer_block.py", "self.layers = torch.nn.ModuleList("),
        Site("models/gpt/gpt_model.py", "self.rotary_pos_emb = RotaryEmbedding("),
        Site("models/gpt/gpt_model.py", "hidden_states = self.decoder("),
    ),
    "rope_frequencies": (  # megatron's llama3 scaling fixes its bounds; scaled models set their own
        Site("models/common/embeddings/rotary_pos_embedding.py", "self.inv_freq = 1.0 / ("),
        Site("models/common/embeddings/rotary_pos_embedding.py", "freqs = torch.outer(seq, self.inv_freq)"),
        Site("models/common/embeddings/rotary_pos_embedding.py", "@lru_cache(maxsize=32)"),
        Site("models/common/embeddings/rotary_pos_embedding.py", "def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:"),
    ),
    "rope_attention_factor": (  # YaRN's factor on the cosines and sines, read from the config by the attention
        Site("models/common/embeddings/yarn_rotary_pos_embedding.py", 'if hasattr(config, "yarn_rotary_scaling_factor"):'),
        Site("models/common/embeddings/yarn_rotary_pos_embedding.py", 'getattr(config, "yarn_mscale", None),'),
        Site("transformer/attention.py", "mscale=_yarn_get_concentration_factor_from_config(self.config),"),
    ),
}


def set_rope_attention_factor(config, factor: float, mscale, mscale_all_dim) -> None:
    """YaRN's attention factor on a plain TransformerConfig: megatron's attention multiplies the
    cosines and sines by the factor its YaRN embedding derives from these (a config of its
    multi-latent attention has them as fields)."""
    config.yarn_rotary_scaling_factor, config.yarn_mscale, config.yarn_mscale_all_dim = factor, mscale, mscale_all_dim


def rope_attention_factor(config) -> float:
    """The factor megatron's attention multiplies RoPE's cosines and sines by (1.0 without YaRN)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config)

    return _yarn_get_concentration_factor_from_config(config)


def attention_layers(gpt_model: torch.nn.Module) -> List[torch.nn.Module]:
    """The SelfAttention module of each transformer layer of this stage, in order."""
    return [layer.self_attention for layer in gpt_model.decoder.layers]


def attention_replaced(gpt_model: torch.nn.Module, make_forward: Callable[[int, torch.nn.Module], Callable]):
    """Within the block, layer i's attention runs ``make_forward(i, attention)(hidden_states,
    **megatron's arguments)`` instead of its own forward (which must return (output, bias))."""
    return methods_replaced(attention_layers(gpt_model), "forward", make_forward)


def rotary_angles(gpt_model: torch.nn.Module, length: int) -> torch.Tensor:
    """The model's RoPE angles for positions 0..length-1: [length, 1, 1, rotary dim] (every
    position, whatever the model's context parallelism: the engine holds whole rows)."""
    return gpt_model.rotary_pos_emb.get_emb(length)


def set_rope_inv_freq(gpt_model: torch.nn.Module, inv_freq: torch.Tensor) -> None:
    """Replace the RoPE frequencies of a model not yet run (its embedding caches by length)."""
    rope = gpt_model.rotary_pos_emb
    rope.inv_freq = inv_freq.to(rope.inv_freq.device)
    rope.forward.cache_clear()
