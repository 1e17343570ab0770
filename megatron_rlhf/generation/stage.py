"""One engine step through this rank's pipeline stage.

The step runs megatron's own modules (embedding, norms, QKV and output projections, MLP, output
layer) but not the wrappers around them (GPTModel, TransformerBlock, TransformerLayer.forward):
at decode batches their per-call bookkeeping (residual/dropout fusions, offload contexts, rotary
and mask set-up) cost as much as the layers' arithmetic on CPU. So the step spells out the
pre-norm residual layer itself, and refuses at start a model whose layers do something else.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_rlhf.generation.kv_cache import SlotKVCache, attend
from megatron_rlhf.generation.packing import StepLayout
from megatron_rlhf.models.decoder import global_rank, groups_of, unwrap
from megatron_rlhf.runtime import megatron_compat as compat

# TransformerConfig switches whose layer differs from `h + attn(norm(h))`, `h + mlp(norm(h))`.
_UNMODELLED_SWITCHES = ("apply_residual_connection_post_layernorm", "fp32_residual_connection", "rotary_interleaved",
                        "multi_latent_attention", "mtp_num_layers")


def unmodelled(config) -> list:
    """The switches set on ``config`` that the engine's step does not model."""
    return [name for name in _UNMODELLED_SWITCHES if getattr(config, name, None)]


class PipelineStage:
    """Packed forwards through this rank's stage with the engine's attention; a context manager
    (the attention is megatron's again once left)."""

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache):
        self.inner, self.cache = unwrap(model), cache
        config = self.inner.config
        refused = unmodelled(config)
        if refused:
            raise ValueError(f"the generation engine does not model {', '.join(refused)}: its step runs the pre-norm "
                             "residual layer (h + attention(norm(h)), h + mlp(norm(h))) with RoPE on halves; set them off")
        pp = groups_of(model).pp
        self.first, self.last = pp.rank() == 0, pp.rank() == pp.size() - 1
        self.prev, self.next = global_rank(pp, pp.rank() - 1), global_rank(pp, pp.rank() + 1)
        self.hidden_size, self.dtype = config.hidden_size, config.pipeline_dtype or config.params_dtype
        # Under sequence parallel the decoder's output is a sequence shard: select after the head.
        self.select_early = not config.sequence_parallel
        self.layout: Optional[StepLayout] = None

    def __enter__(self):
        self._attention = compat.attention_replaced(
            self.inner, lambda i, attention: (lambda hidden, *a, **k: attend(attention, i, self.cache, self.layout, hidden)))
        self._attention.__enter__()
        return self

    def __exit__(self, *exc):
        return self._attention.__exit__(*exc)

    def forward(self, tokens: torch.Tensor, layout: StepLayout, keep: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """tokens [1, T] -> the full-vocabulary logits [len(keep), V] at ``keep`` (None: every
        position) on the last stage, else None (the hidden states went on to the next stage)."""
        self.layout = layout
        inner = self.inner
        if self.first:
            hidden = inner.embedding(input_ids=tokens, position_ids=layout.positions.unsqueeze(0))
        else:
            hidden = torch.empty(tokens.shape[1], 1, self.hidden_size, dtype=self.dtype, device=tokens.device)
            dist.recv(hidden, src=self.prev)
        for layer in inner.decoder.layers:
            hidden = _residual(hidden, layer.self_attention(layer.input_layernorm(hidden)))
            hidden = _residual(hidden, layer.mlp(layer.pre_mlp_layernorm(hidden)))
        if not self.last:
            dist.send(hidden.contiguous(), dst=self.next)
            return None
        if self.select_early and keep is not None:
            hidden = hidden.index_select(0, keep)
        if inner.decoder.final_layernorm is not None:
            hidden = inner.decoder.final_layernorm(hidden)
        weight = inner.shared_embedding_or_output_weight() if inner.share_embeddings_and_output_weights else None
        logits, _ = inner.output_layer(hidden, weight=weight, runtime_gather_output=True)
        return logits[:, 0] if self.select_early or keep is None else logits[:, 0].index_select(0, keep)


def _residual(hidden: torch.Tensor, output_and_bias) -> torch.Tensor:
    output, bias = output_and_bias
    return hidden + output if bias is None else hidden + output + bias
