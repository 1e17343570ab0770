"""Batched generation from a Megatron policy with a KV cache, under TP and PP.

All rows advance in lockstep, one position per step, from the shortest prompt on: a row whose
prompt is longer is fed its own prompt token at that position instead of a sample, so no row ever
attends to padding and no attention mask is needed. The cache is megatron-core's
``StaticInferenceContext``; pipeline stages hand hidden states on with point-to-point sends, the
last stage samples from the TP-gathered logits, and the tokens go back to every stage.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch
import torch.distributed as dist

from megatron_rlhf.generation.sampling import SamplingParams, sample_next
from megatron_rlhf.models.batches import action_mask
from megatron_rlhf.models.llama import unwrap
from megatron_rlhf.models.pipeline import broadcast_from_last_stage


@dataclasses.dataclass
class Generated:
    """Prompt then response in each row, right-padded with the pad id.

    tokens [B, S]; prompt_lengths [B]; response_lengths [B] (the EOS token, when emitted, is the
    last response token).
    """

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor

    @property
    def total_lengths(self) -> torch.Tensor:
        return self.prompt_lengths + self.response_lengths

    def action_mask(self) -> torch.Tensor:
        """[B, S-1] (see models/batches.py): 1 where the action emitted a response token."""
        return action_mask(self.tokens.shape[1], self.prompt_lengths, self.response_lengths)


def right_pad(prompts: torch.Tensor, lengths: torch.Tensor, pad_id: int, side: Literal["left", "right"]) -> torch.Tensor:
    """[B, P] prompts padded on ``side`` -> the same prompts padded on the right."""
    if side == "right":
        return prompts
    if side != "left":
        raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
    out = torch.full_like(prompts, pad_id)
    width = prompts.shape[1]
    for row, n in enumerate(lengths.tolist()):
        out[row, :n] = prompts[row, width - n :]
    return out


def _forward_chunk(model, tokens: torch.Tensor, start: int, context, hidden_size: int) -> Optional[torch.Tensor]:
    """Feed positions [start, start + n) of every row through this rank's stage. Returns the
    last position's full-vocabulary logits [B, V] on the last stage, None elsewhere."""
    from megatron.core import parallel_state as ps

    inner = unwrap(model)
    batch, n = tokens.shape
    positions = torch.arange(start, start + n, device=tokens.device).unsqueeze(0).expand(batch, n)
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(n, batch, hidden_size, dtype=inner.config.pipeline_dtype, device=tokens.device)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        inner.set_input_tensor(hidden)
    output = model(tokens, positions, None, inference_context=context, runtime_gather_output=True)
    context.increment_sequence_len_offset(n)
    if not ps.is_pipeline_last_stage():
        dist.send(output.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return output[:, -1, :]


def _decided_once(sampled: torch.Tensor) -> torch.Tensor:
    """The TP group's first rank's samples on every TP rank: the ranks can never disagree on a
    token (and so on when a row is done), whatever their generators or kernels do."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(sampled, src=ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group())
    return sampled


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    prompt_lengths: torch.Tensor,
    params: SamplingParams,
    vocab_size: int,
    generator: Optional[torch.Generator] = None,
    padding_side: Literal["left", "right"] = "right",
    batch_size: Optional[int] = None,
) -> Generated:
    """Responses to a batch of prompts [B, P] (``prompt_lengths`` [B] real tokens each).

    Every rank of the model-parallel group calls this with the same prompts and gets the same
    result. ``vocab_size``: the tokenizer's vocabulary; the padded rows of the output layer are
    never sampled. ``generator`` drives sampling; seed it alike on every rank of the group.
    ``batch_size``: decode at most this many rows at once (the KV cache scales with it).
    """
    if batch_size is not None and batch_size < prompts.shape[0]:
        parts = [
            generate(model, prompts[i : i + batch_size], prompt_lengths[i : i + batch_size], params, vocab_size,
                     generator, padding_side)
            for i in range(0, prompts.shape[0], batch_size)
        ]
        width = max(p.tokens.shape[1] for p in parts)
        return Generated(
            torch.cat([torch.nn.functional.pad(p.tokens, (0, width - p.tokens.shape[1]), value=params.pad_id) for p in parts]),
            torch.cat([p.prompt_lengths for p in parts]),
            torch.cat([p.response_lengths for p in parts]),
        )
    from megatron.core.inference.contexts import StaticInferenceContext

    if prompts.dim() != 2 or prompt_lengths.shape != prompts.shape[:1]:
        raise ValueError(f"prompts must be [B, P] with prompt_lengths [B], got {tuple(prompts.shape)} and {tuple(prompt_lengths.shape)}")
    if int(prompt_lengths.min()) < 1:
        raise ValueError("every prompt needs at least one token")
    inner = unwrap(model)
    device = next(inner.parameters()).device
    lengths = prompt_lengths.to(device)
    batch = prompts.shape[0]
    width = int(lengths.max()) + params.max_new_tokens
    tokens = torch.full((batch, width), params.pad_id, dtype=torch.long, device=device)
    prompts = right_pad(prompts.to(device), lengths, params.pad_id, padding_side)
    tokens[:, : prompts.shape[1]] = prompts[:, :width]
    response_lengths = torch.zeros(batch, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)

    was_training = model.training
    model.eval()
    context = StaticInferenceContext(batch, width)
    fed = 0
    try:
        for position in range(int(lengths.min()), width):
            logits = _forward_chunk(model, tokens[:, fed:position], fed, context, inner.config.hidden_size)
            if fed == 0:
                context.enable_decode_mode()
            fed = position
            sampled = None if logits is None else _decided_once(sample_next(logits[:, :vocab_size], params, generator))
            sampled = broadcast_from_last_stage(sampled, (batch,), torch.long, device)
            in_prompt = position < lengths
            generating = ~in_prompt & ~done
            tokens[:, position] = torch.where(in_prompt, tokens[:, position], torch.where(generating, sampled, params.pad_id))
            response_lengths += generating.long()
            ended = response_lengths >= params.max_new_tokens
            if params.eos_id is not None:
                ended |= generating & (sampled == params.eos_id)
            done |= ended & ~in_prompt
            if bool(done.all()):
                break
    finally:
        model.train(was_training)
    used = int((lengths + response_lengths).max())
    return Generated(tokens[:, :used], lengths, response_lengths)
