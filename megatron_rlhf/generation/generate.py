"""Generation from a Megatron policy under TP and PP: a continuous-batching engine.

A fixed number of decode slots each hold one row at a time. Every step is one forward of a packed
sequence: the whole prompt of each row admitted this step (one prefill per prompt, whatever the
spread of prompt lengths), then the last token of every decoding row (kv_cache.py). When a row
ends (EOS or max_new_tokens) its slot takes the next waiting prompt, so no slot idles while
prompts wait and no token is computed for padding.

The schedule is decided on the host from what every rank knows alike: lengths are counted there,
and EOS is learnt from the device ``completion_lag`` steps late (a copy started right after each
step is read ``lag`` steps later), so on CUDA the host never waits for the step it just queued; a
row that ended meanwhile computes a few tokens that are not kept. What a row samples does not
depend on the schedule: its n-th token is the n-th draw of its own stream (sampling.py). The last
stage samples from the TP-gathered logits; the tokens go to every TP rank and every stage.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Callable, Literal, Optional

import torch
import torch.distributed as dist

from megatron_rlhf.generation.kv_cache import SlotKVCache, StepLayout, attend
from megatron_rlhf.generation.sampling import SamplingParams, sample_next
from megatron_rlhf.models.batches import action_mask
from megatron_rlhf.models.decoder import unwrap
from megatron_rlhf.models.pipeline import broadcast_from_last_stage
from megatron_rlhf.runtime import megatron_compat as compat
from megatron_rlhf.runtime.platform import get_platform

# Prompt tokens admitted per step at most (a longer prompt still gets its one prefill, alone):
# bounds a step's activations, as vLLM's max_num_batched_tokens does.
PREFILL_TOKENS = 8192


@dataclasses.dataclass
class EngineStats:
    """forward_passes: engine steps; computed_tokens: tokens fed (prompts + decode tokens);
    sampled: tokens sampled (one per prefill and per decode token); useful: tokens kept in a
    response; slot_steps: slots x steps (idle slots included)."""

    forward_passes: int = 0
    computed_tokens: int = 0
    sampled: int = 0
    useful: int = 0
    slot_steps: int = 0


@dataclasses.dataclass
class Generated:
    """Prompt then response in each row, right-padded with the pad id.

    tokens [B, S]; prompt_lengths [B]; response_lengths [B] (the EOS token, when emitted, is the
    last response token).
    """

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    stats: EngineStats = dataclasses.field(default_factory=EngineStats)

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


def _decided_once(sampled: torch.Tensor) -> torch.Tensor:
    """The TP group's first rank's samples on every TP rank: the ranks can never disagree on a
    token (and so on when a row is done), whatever their kernels do."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(sampled, src=ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group())
    return sampled


class _Stage:
    """One packed forward through this rank's pipeline stage, with the engine's attention."""

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, rope: torch.Tensor):
        from megatron.core import parallel_state as ps

        self.model, self.inner, self.cache, self.rope = model, unwrap(model), cache, rope
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.prev, self.next = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
        self.layout: Optional[StepLayout] = None
        self.keep: Optional[torch.Tensor] = None  # positions whose logits are wanted
        # Under sequence parallel the decoder's output is a sequence shard: select after the head.
        self.select_early = not self.inner.config.sequence_parallel

    def __enter__(self):
        self._attention = compat.attention_replaced(
            self.inner, lambda i, attention: (lambda hidden, *a, **k: attend(attention, i, self.cache, self.layout, hidden)))
        self._attention.__enter__()
        self._hook = self.inner.decoder.register_forward_hook(self._select) if self.last and self.select_early else None
        return self

    def __exit__(self, *exc):
        if self._hook is not None:
            self._hook.remove()
        return self._attention.__exit__(*exc)

    def _select(self, module, inputs, hidden):
        return hidden.index_select(0, self.keep)

    def forward(self, tokens: torch.Tensor, layout: StepLayout, keep: torch.Tensor) -> Optional[torch.Tensor]:
        """tokens [1, T] -> the full-vocabulary logits [len(keep), V] at ``keep`` on the last stage, else None."""
        layout.rope = self.rope.index_select(0, layout.positions)
        self.layout, self.keep = layout, keep
        if not self.first:
            hidden = torch.empty(tokens.shape[1], 1, self.inner.config.hidden_size, dtype=self.inner.config.pipeline_dtype,
                                 device=tokens.device)
            dist.recv(hidden, src=self.prev)
            self.inner.set_input_tensor(hidden)
        output = self.model(tokens, None, None, runtime_gather_output=True)
        if not self.last:
            dist.send(output.contiguous(), dst=self.next)
            return None
        return output[0] if self.select_early else output[0].index_select(0, keep)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    prompt_lengths: torch.Tensor,
    params: SamplingParams,
    vocab_size: int,
    seeds: Optional[torch.Tensor] = None,
    padding_side: Literal["left", "right"] = "right",
    batch_size: Optional[int] = None,
    cache_length: Optional[int] = None,
    completion_lag: Optional[int] = None,
    on_cache: Optional[Callable[[SlotKVCache], object]] = None,
) -> Generated:
    """Responses to a batch of prompts [B, P] (``prompt_lengths`` [B] real tokens each).

    Every rank of the model-parallel group calls this with the same arguments and gets the same
    result. ``vocab_size``: the tokenizer's vocabulary; the padded rows of the output layer are
    never sampled. ``seeds`` [B]: each row's sampling stream (default: the row index); rows with
    equal seeds draw alike. ``batch_size``: decode slots, rows generated at once (default: all);
    the KV cache holds ``batch_size`` x ``cache_length`` positions (default length: the longest
    prompt plus max_new_tokens). ``completion_lag``: steps between a row's EOS and the host
    learning of it (default 0 on CPU, 2 on CUDA; the result does not depend on it).
    ``on_cache(cache)``: a context manager entered once the KV cache is allocated and left once
    it is released (the EMS ledger's record of it).
    """
    from megatron.core import parallel_state as ps

    if prompts.dim() != 2 or prompt_lengths.shape != prompts.shape[:1]:
        raise ValueError(f"prompts must be [B, P] with prompt_lengths [B], got {tuple(prompts.shape)} and {tuple(prompt_lengths.shape)}")
    rows = prompts.shape[0]
    lengths = [int(n) for n in prompt_lengths.tolist()]
    if rows == 0 or min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    inner = unwrap(model)
    config = inner.config
    device = next(inner.parameters()).device
    slots = min(rows, batch_size or rows)
    width = max(lengths) + params.max_new_tokens  # the longest row
    cache_length = cache_length or width
    if cache_length < width:
        raise ValueError(f"cache_length {cache_length} < longest prompt {max(lengths)} + max_new_tokens {params.max_new_tokens}")
    platform = get_platform()
    lag = platform.completion_lag if completion_lag is None else completion_lag
    tp = ps.get_tensor_model_parallel_world_size()
    pad_to = tp if config.sequence_parallel else 1  # the packed sequence is split over TP ranks
    scratch = slots if pad_to > 1 else None  # a slot no row uses, for padding tokens

    prompts = right_pad(prompts.to(device), prompt_lengths.to(device), params.pad_id, padding_side)
    seeds = (torch.arange(rows) if seeds is None else seeds).to(device=device, dtype=torch.int64)
    tokens = torch.full((rows, width + 1), params.pad_id, dtype=torch.long, device=device)  # last column: discards
    tokens[:, : min(prompts.shape[1], width)] = prompts[:, :width]  # a wider prompt tensor holds only padding there
    prompt_len_dev = torch.tensor(lengths, device=device)
    response_lengths = torch.zeros(rows, dtype=torch.long, device=device)
    alive = torch.zeros(slots, dtype=torch.bool, device=device)
    last_token = torch.zeros(slots, dtype=torch.long, device=device)
    eos_ids = torch.tensor(params.eos_ids, dtype=torch.long, device=device) if params.eos_ids else None

    cache = SlotKVCache(len(compat.attention_layers(inner)), slots + (scratch is not None), cache_length,
                        config.num_query_groups // tp if config.num_query_groups else config.num_attention_heads // tp,
                        config.kv_channels, config.params_dtype, device)
    stats = EngineStats()
    waiting = collections.deque(range(rows))
    row_in = [-1] * slots  # host: the row each slot holds, -1 when free
    produced = [0] * slots  # tokens sampled for that row so far
    fed = [0] * slots  # positions of that row in the cache
    pending = collections.deque()  # (step, rows per slot then, alive flags copied from the device)
    with contextlib.ExitStack() as stack:  # left in reverse: stage, train mode, cache freed, then on_cache
        if on_cache is not None:
            stack.enter_context(on_cache(cache))
        stack.callback(cache.release)
        stack.callback(model.train, model.training)
        model.eval()
        stage = stack.enter_context(_Stage(model, cache, compat.rotary_angles(inner, cache_length).to(device)))
        step = 0
        while True:
            for s in range(slots):  # ended by length: known here
                if row_in[s] >= 0 and produced[s] >= params.max_new_tokens:
                    row_in[s] = -1
            while pending and (pending[0][0] <= step - lag or not waiting and all(r < 0 for r in row_in)):
                _, held, flags = pending.popleft()  # ended by EOS: learnt lag steps late
                for s, flag in enumerate(flags().tolist()):
                    if not flag and row_in[s] == held[s] >= 0:
                        row_in[s] = -1
            admitted, budget = [], PREFILL_TOKENS
            for s in range(slots):
                if row_in[s] < 0 and waiting and (not admitted or lengths[waiting[0]] <= budget):
                    r = waiting.popleft()
                    row_in[s], produced[s], fed[s] = r, 0, 0
                    budget -= lengths[r]
                    admitted.append(s)
            decoding = [s for s in range(slots) if row_in[s] >= 0 and s not in admitted]
            if not admitted and not decoding:
                if pending:
                    continue
                break
            # The packed step: admitted prompts, then one token per decoding row.
            parts, positions, token_slots, prefill, keep = [], [], [], [], []
            for s in admitted:
                n = lengths[row_in[s]]
                prefill.append((len(positions), n))
                parts.append(prompts[row_in[s], :n])
                positions.extend(range(n))
                token_slots.extend([s] * n)
                keep.append(len(positions) - 1)
            padding = -(len(positions) + len(decoding)) % pad_to
            if padding:  # a segment of its own, in the scratch slot; its logits are not kept
                prefill.append((len(positions), padding))
                parts.append(torch.full((padding,), params.pad_id, dtype=torch.long, device=device))
                positions.extend(range(padding))
                token_slots.extend([scratch] * padding)
            decode_start = len(positions)
            decode_slots = torch.tensor(decoding, device=device) if decoding else None
            if decoding:
                parts.append(last_token[decode_slots])
                positions.extend(fed[s] for s in decoding)
                token_slots.extend(decoding)
                keep.extend(range(decode_start, len(positions)))
            span = (decoding[0], decoding[-1] + 1) if decoding and decoding[-1] - decoding[0] + 1 == len(decoding) else None
            layout = StepLayout(
                torch.tensor(positions, device=device), torch.tensor(token_slots, device=device), prefill,
                decode_start, decode_slots, span, max((fed[s] + 1 for s in decoding), default=0),
            )
            logits = stage.forward(torch.cat(parts).unsqueeze(0), layout, torch.tensor(keep, device=device))

            out_slots = admitted + decoding
            out_rows = torch.tensor([row_in[s] for s in out_slots], device=device)
            counters = torch.tensor([produced[s] for s in out_slots], device=device)
            sampled = None
            if logits is not None:
                sampled = _decided_once(sample_next(logits[:, :vocab_size], params, seeds[out_rows], counters))
            sampled = broadcast_from_last_stage(sampled, (len(out_slots),), torch.long, device)

            slot_index = torch.tensor(out_slots, device=device)
            alive[slot_index[: len(admitted)]] = True  # out_slots begin with the admitted
            write = alive[slot_index]
            column = torch.where(write, prompt_len_dev[out_rows] + counters, width)
            tokens[out_rows, column] = sampled
            response_lengths.index_add_(0, out_rows, write.long())
            if eos_ids is not None:
                alive[slot_index] = write & ~torch.isin(sampled, eos_ids)
            last_token[slot_index] = sampled
            for s in admitted:
                fed[s] = lengths[row_in[s]]
            for s in decoding:
                fed[s] += 1
            for s in out_slots:
                produced[s] += 1
            if eos_ids is not None:
                pending.append((step, list(row_in), platform.copy_to_host_async(alive)))
            stats.forward_passes += 1
            stats.computed_tokens += len(positions)
            stats.sampled += len(out_slots)
            stats.slot_steps += slots
            step += 1
    stats.useful = int(response_lengths.sum())
    used = int((prompt_len_dev + response_lengths).max())
    return Generated(tokens[:, :used], prompt_len_dev, response_lengths, stats)
