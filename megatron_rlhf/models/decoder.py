"""Builders of Megatron GPT models of the Llama line (the families of config/families.py) with a
language-model or a scalar head.

A built model is a megatron ``GPTModel`` for this process's pipeline stage and TP rank (wrapped in
``Float16Module`` for bf16). Trainable models are further wrapped in megatron DDP (see training.py).
"""

from __future__ import annotations

from typing import Literal, Optional

import math

import torch
import torch.nn.functional as F

from megatron_rlhf.config.schema import ModelArchConfig, ParallelConfig
from megatron_rlhf.models import batch_invariant
from megatron_rlhf.runtime import megatron_compat as compat
from megatron_rlhf.runtime.platform import get_platform

Head = Literal["lm", "scalar"]


def make_transformer_config(
    arch: ModelArchConfig,
    parallel: ParallelConfig,
    precision: str = "fp32",
    recompute_activations: bool = False,
    cuda_graph_impl: str = "none",
):
    """megatron TransformerConfig of ``arch`` (no dropout: RLHF needs the same log-probs in rollout
    and training). The RoPE frequencies are set on the built model (:func:`rope_inv_freq`)."""
    from megatron.core.transformer import TransformerConfig

    extra = experts_config(arch, parallel)
    if recompute_activations:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.kv_groups,
        ffn_hidden_size=arch.ffn_hidden_size,
        kv_channels=arch.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        # megatron's window (left, right) counts the tokens before and after; ours includes the token.
        window_size=(arch.sliding_window - 1, 0) if arch.sliding_window else None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        # megatron's rotary embedding then keeps each CP rank's angles (models/context_parallel.py)
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
        bf16=precision == "bf16",
        pipeline_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
        use_cpu_initialization=get_platform().use_cpu_initialization,
        # Fused kernels where the platform has them (all off on CPU); the unfused paths compute the same.
        **get_platform().kernel_fusions(),
        # Losses are (sum, count) and the gradient is sum / count over the global batch
        # (models/pipeline.py), so it does not depend on micro-batch size, DP or PP.
        calculate_per_token_loss=True,
        # Micro-batches are trimmed to their own longest row (models/batches.py): under PP the
        # stages exchange each activation's shape before it.
        variable_seq_lengths=parallel.pipeline_model_parallel_size > 1,
        cuda_graph_impl=cuda_graph_impl,
        **extra,
    )
    if arch.rope_scaling == "yarn":
        compat.set_rope_attention_factor(config, arch.rope_scaling_factor, arch.rope_mscale, arch.rope_mscale_all_dim)
    return config


def experts_config(arch: ModelArchConfig, parallel: ParallelConfig) -> dict:
    """megatron's MoE settings for ``arch``: its softmax router (top-k then softmax over the chosen
    logits is the renormalised top-k of the full softmax; without renormalisation the softmax comes
    first), in fp32 whatever the weights (as transformers routes), no token dropped (capacity
    unbounded, as transformers), and each expert split over the TP ranks. The all-to-all
    dispatcher: the all-gather one needs equal token counts on every EP rank, which micro-batches
    trimmed to their own longest row do not have."""
    settings = {"moe_token_dispatcher_type": "alltoall"}  # megatron's default refuses variable_seq_lengths
    if not arch.num_experts:
        return settings
    balancing = arch.moe_aux_loss_coeff > 0
    return dict(
        settings,
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_router_topk,
        moe_router_pre_softmax=not arch.moe_norm_topk_prob,
        moe_layer_freq=arch.moe_layers(),
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss" if balancing else "none",
        moe_aux_loss_coeff=arch.moe_aux_loss_coeff,
        moe_z_loss_coeff=arch.moe_z_loss_coeff or None,
        moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=arch.moe_shared_expert_ffn_hidden_size is not None,  # Qwen2-MoE's sigmoid gate
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.tensor_model_parallel_size,
    )


class ScalarHead(torch.nn.Module):
    """One value per token: a [1, hidden] projection, replicated on every TP rank.

    Takes the place of GPTModel.output_layer, with its call signature, so the rest of GPTModel
    (pipeline stages, sequence parallel, Float16Module) works unchanged.
    """

    def __init__(self, config, hidden_size: int):
        from megatron.core import tensor_parallel

        super().__init__()
        self.config = config
        self.sequence_parallel = config.sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=config.params_dtype))
        with torch.no_grad():
            master = torch.empty(1, hidden_size, dtype=torch.float32)
            config.init_method(master)
            self.weight.copy_(master.to(config.params_dtype))
        # Not TP-split: grad clipping counts it once, on TP rank 0.
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(self.weight)
        if self.sequence_parallel:
            # Its grads come from a sequence shard per TP rank: megatron all-reduces params so marked.
            self.weight.sequence_parallel = True

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        # hidden_states: [s, b, h] (or [s/tp, b, h] under sequence parallel) -> values [s(/tp), b, 1].
        # In fp32 whatever the weights' dtype: a bf16 score near 5.0 would be resolved to 1/32.
        # Under sequence parallel each rank keeps its sequence shard; gather so every TP rank
        # returns the full sequence like a gathered LM head would.
        if batch_invariant.enabled():
            values = batch_invariant.row_blocked_linear(hidden_states.float(), self.weight.float(), None)
        else:
            values = torch.matmul(hidden_states.float(), self.weight.float().t())
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def layer_spec(arch: ModelArchConfig, config, attention: str = "fused"):
    """transformer-engine layers on GPU when installed, megatron-core's local layers otherwise
    (their core attention on torch's fused kernels unless ``attention`` is local: attention.py);
    with experts, megatron's block spec (this stage's layers, each with experts or dense as
    ``config.moe_layer_freq`` says)."""
    te = get_platform().has_transformer_engine
    if te and attention == "local":
        raise ValueError("attention: local: transformer-engine is installed, whose layers bring their own fused "
                         "attention; megatron's local attention is used only where it is absent (use attention: fused)")
    if arch.num_experts:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te)
    elif te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm)
    from megatron_rlhf.models.attention import with_core_attention

    return spec if te else with_core_attention(spec, attention)


def rope_inv_freq(arch: ModelArchConfig) -> torch.Tensor:
    """RoPE's inverse frequencies [kv_channels / 2] (fp32) with ``arch``'s scaling.

    linear: every frequency divided by the factor. llama3: wavelengths 2*pi/f longer than
    original / low_freq_factor are divided by the factor, those shorter than original /
    high_freq_factor kept, and the band between interpolated linearly in original / wavelength.
    yarn: megatron's YarnRotaryEmbedding's (transformers' alike); its attention factor is set on the
    config (make_transformer_config), which megatron's attention and the engine read.
    """
    dim = arch.kv_channels
    inv_freq = 1.0 / (arch.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if arch.rope_scaling == "linear":
        return inv_freq / arch.rope_scaling_factor
    if arch.rope_scaling == "llama3":
        original, factor = arch.rope_original_max_position_embeddings, arch.rope_scaling_factor
        low, high = arch.rope_low_freq_factor, arch.rope_high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(wavelength > original / low, inv_freq / factor,
                           torch.where(wavelength < original / high, inv_freq, interpolated))
    if arch.rope_scaling == "yarn":  # megatron's YarnRotaryEmbedding's frequencies, by its own functions
        from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

        interpolated = 1.0 / (arch.rope_scaling_factor * arch.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        low, high = yarn._yarn_find_correction_range(arch.rope_beta_fast, arch.rope_beta_slow, dim, arch.rotary_base,
                                                     arch.rope_original_max_position_embeddings, arch.rope_truncate)
        kept = 1.0 - yarn._yarn_linear_ramp_mask(low, high, dim // 2, device=inv_freq.device).to(dtype=torch.float32)
        return interpolated * (1 - kept) + inv_freq * kept
    return inv_freq


def build_model(
    arch: ModelArchConfig,
    parallel: ParallelConfig,
    head: Head,
    precision: str = "fp32",
    recompute_activations: bool = False,
    cuda_graph_impl: str = "none",
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    pg_collection=None,
    padded_vocab: Optional[int] = None,
    attention: str = "fused",
    logprob_chunk_tokens: int = 0,
    pack_rows: bool = False,
) -> torch.nn.Module:
    """This rank's piece of the model (its pipeline stage, its TP shard), on the platform device.
    ``pg_collection``: the process groups of ``parallel`` when it is not the run's layout
    (runtime/layouts.py); ``padded_vocab``: the vocabulary rows (default: padded for ``parallel``'s TP;
    models that exchange weights across layouts need one size); ``attention``: the core attention
    where transformer-engine is absent (models/attention.py); ``logprob_chunk_tokens``: an LM head's
    log-probs and entropy computed that many tokens at a time (0: from whole logits;
    models/vocab_parallel.py); ``pack_rows``: its passes run a micro-batch's rows laid end to end
    without padding (models/packed_rows.py)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    if parallel.sequence_parallel and not get_platform().has_transformer_engine:
        raise ValueError(
            "parallel.sequence_parallel: needs transformer-engine on a CUDA machine (megatron's "
            "torch norm layers do not support it); set sequence_parallel: false"
        )
    config = make_transformer_config(arch, parallel, precision, recompute_activations, cuda_graph_impl)
    stage, stages = ((pg_collection.pp.rank(), pg_collection.pp.size()) if pg_collection is not None else
                     (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()))
    if pre_process is None:
        pre_process = stage == 0
    if post_process is None:
        post_process = stage == stages - 1
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, config, attention),
        vocab_size=padded_vocab or arch.padded_vocab_size(parallel.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tied_output(head),
        position_embedding_type="rope",
        rotary_base=int(arch.rotary_base),
        pg_collection=pg_collection,
    )
    if arch.rope_scaling != "none":
        compat.set_rope_inv_freq(model, rope_inv_freq(arch))
    if post_process and head == "scalar":
        model.output_layer = ScalarHead(config, arch.hidden_size)
    elif head not in ("lm", "scalar"):
        raise ValueError(f"head must be 'lm' or 'scalar', got {head!r}")
    elif post_process:
        model.logprob_chunk_tokens = logprob_chunk_tokens
    model.pack_rows = pack_rows
    if batch_invariant.enabled():
        batch_invariant.install(model)
    model = get_platform().place_module(model)
    if precision == "bf16":
        model = Float16Module(config, model)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def groups_of(model: torch.nn.Module):
    """The process groups ``model`` was built on (megatron's ProcessGroupCollection: the run's
    parallel_state groups, or a layout of its own, runtime/layouts.py). Code that runs a model
    reads its TP/PP/DP groups here, never from the global parallel_state."""
    return unwrap(model).pg_collection


def global_rank(group, rank: int) -> int:
    """The world rank of ``group``'s member ``rank`` (negative counts from the end)."""
    import torch.distributed as dist

    return dist.get_global_rank(group, rank % group.size())


def local_state_dict(model: torch.nn.Module) -> dict:
    """This rank's weights under the local-layer names of sharding.py (whatever the layer spec)."""
    from megatron_rlhf.models.sharding import to_local_layer_names

    return to_local_layer_names({k: v for k, v in unwrap(model).state_dict().items()})


def load_local_state_dict(model: torch.nn.Module, state_dict: dict) -> None:
    """Load weights given under local-layer names; every weight of the model must be given."""
    from megatron_rlhf.models.sharding import to_te_layer_names

    inner = unwrap(model)
    expected = {k for k in inner.state_dict() if not k.endswith("._extra_state")}
    if get_platform().has_transformer_engine:
        state_dict = to_te_layer_names(state_dict, expected)
    missing, unexpected = expected - set(state_dict), set(state_dict) - expected
    if missing or unexpected:
        raise ValueError(
            f"state dict does not fit the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    inner.load_state_dict(state_dict, strict=False)
