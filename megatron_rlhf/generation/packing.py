"""One engine step as one packed sequence [1, T], and where each of its tokens belongs.

The prompt of each row admitted this step comes first (its prefill: the whole prompt, or the
tokens after those its slot's cache already holds), then one token per decoding row. Everything
the attention of every layer needs to know about the step is worked out here once (the cache
positions written, the rotary angles, the prefill groups, the decode mask), so the per-layer
attention (kv_cache.py) does tensor work only.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_rlhf.generation.schedule import ScheduledStep
from megatron_rlhf.runtime import megatron_compat as compat

@dataclasses.dataclass
class PrefillGroup:
    """Prompts of one length n fed after ``offset`` cached positions, attended in one call:
    ``index`` [G, n] the packed positions of each prompt's tokens; ``span`` (start, n) when the
    group is one prompt (read as a slice); ``mask`` [n, offset + n] under a sliding window or
    after cached positions, else None (causal); ``slots`` [G] (offset > 0: whose cache holds the
    earlier positions)."""

    index: torch.Tensor
    span: Optional[Tuple[int, int]]
    mask: Optional[torch.Tensor] = None
    offset: int = 0
    slots: Optional[torch.Tensor] = None


@dataclasses.dataclass
class StepLayout:
    """Where each token of one packed step [1, T] belongs (device tensors unless said).

    positions, slots: [T] each token's position in its row and its slot (the cache write).
    cos, sin: [T, 1, 1, rotary dim] the rotary factors at ``positions``.
    prefill: the prompts' attention groups; window: a sliding window's ``left`` (host) or None.
    decode_start (host): where the decode tokens begin. decode_span (host): (first, end) slots read
    by the decode attention (every slot between the first and the last decoding one);
    decode_rows [D]: each decode token's slot - first; decode_bias [end-first, 1, 1, extent]: 0
    where a slot's query may attend, -inf elsewhere (a slot not decoding this step sees position 0
    only, and its output is dropped).
    """

    positions: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    prefill: List[PrefillGroup]
    window: Optional[int]
    decode_start: int
    decode_span: Optional[Tuple[int, int]] = None
    decode_rows: Optional[torch.Tensor] = None
    decode_bias: Optional[torch.Tensor] = None

    @property
    def decodes(self) -> bool:
        return self.decode_span is not None


def prefill_groups(lengths: Sequence, offsets: Optional[Sequence[int]] = None) -> List[List[int]]:
    """The prompts of a step (their lengths, in packed order) grouped for one attention call per
    group: prompts of equal length (the samples of one prompt under GRPO are admitted together)
    after equal cached positions (``offsets``, default none).

    Measured on CPU (32 prompts of 8-384 tokens, whole generation): padding unequal prompts into
    shared calls costs more than the calls it saves (1.06-1.09 s with equal-length groups only,
    1.11 s with up to 1.5x the attention work padded, 1.16-1.25 s with up to 3x); one causal
    call over the whole packed sequence with a block-diagonal mask computes all T^2 scores; torch's
    nested-tensor attention has no causal CPU kernel. A varlen kernel (GPU) would take a whole step
    in one call."""
    groups: dict = {}
    for i, key in enumerate(zip(lengths, offsets or [0] * len(lengths))):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _group(starts: Sequence[int], n: int, offset: int, members: List[int], slots: Sequence[int],
           window: Optional[int], device: torch.device) -> PrefillGroup:
    steps = torch.arange(n, device=device)
    mask = None if window is None and not offset else visible(offset + steps, offset + n, window)
    cached_in = torch.tensor([slots[m] for m in members], device=device) if offset else None
    if len(members) == 1:
        return PrefillGroup((starts[members[0]] + steps)[None], (starts[members[0]], n), mask, offset, cached_in)
    first = torch.tensor([starts[m] for m in members], device=device)[:, None]
    return PrefillGroup(first + steps, None, mask, offset, cached_in)


def rope_factors(angles: torch.Tensor, rope_factor: float, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cosines and sines of ``angles``, as megatron's attention makes them (times YaRN's factor)."""
    return (torch.cos(angles) * rope_factor).to(dtype), (torch.sin(angles) * rope_factor).to(dtype)


def visible(query_positions: torch.Tensor, extent: int, window: Optional[int]) -> torch.Tensor:
    """[len(query_positions), extent]: the cache positions each query position attends to (causal,
    within ``window`` positions before it when a sliding window is set)."""
    distance = query_positions.unsqueeze(1) - torch.arange(extent, device=query_positions.device)
    return (distance >= 0) if window is None else (distance >= 0) & (distance <= window)


def pack_step(prompt_lengths: Sequence[int], prompt_slots: Sequence[int], decode_slots: Sequence[int],
              decode_positions: Sequence[int], rotary: torch.Tensor, window: Optional[int], dtype: torch.dtype,
              device: torch.device, prompt_offsets: Optional[Sequence[int]] = None, rope_factor: float = 1.0) -> StepLayout:
    """The layout of a step feeding prompts of ``prompt_lengths`` into ``prompt_slots`` (at
    positions ``prompt_offsets`` on, after what the slot's cache holds; default 0), then one token
    for each of ``decode_slots`` at ``decode_positions``. ``rotary`` [L, 1, 1, dim]: the model's
    angles by position; ``rope_factor``: YaRN's on their cosines and sines."""
    offsets = list(prompt_offsets) if prompt_offsets is not None else [0] * len(prompt_lengths)
    starts, total = [], 0
    for n in prompt_lengths:
        starts.append(total)
        total += n
    # Everything known on the host in one transfer: decode positions, slots, rows in the span read,
    # and the position of every slot of that span (0 for a slot not decoding: it sees position 0 only).
    decoded = len(decode_slots)
    lo, hi = (min(decode_slots), max(decode_slots) + 1) if decoded else (0, 0)
    span_positions = [0] * (hi - lo)
    for slot, position in zip(decode_slots, decode_positions):
        span_positions[slot - lo] = position
    host = torch.tensor([*decode_positions, *decode_slots, *(s - lo for s in decode_slots), *span_positions],
                        dtype=torch.long).to(device)
    positions, slots, rows = host[:decoded], host[decoded : 2 * decoded], host[2 * decoded : 3 * decoded]
    if prompt_lengths:
        segment = torch.repeat_interleave(torch.arange(len(prompt_lengths), device=device),
                                          torch.tensor(prompt_lengths, dtype=torch.long, device=device), output_size=total)
        first = torch.tensor([a - o for a, o in zip(starts, offsets)], device=device, dtype=torch.long)
        positions = torch.cat([torch.arange(total, device=device) - first[segment], positions])
        slots = torch.cat([torch.tensor(list(prompt_slots), device=device, dtype=torch.long)[segment], slots])
    layout = StepLayout(positions, slots, *rope_factors(rotary.index_select(0, positions), rope_factor, dtype),
                        [_group(starts, prompt_lengths[g[0]], offsets[g[0]], g, prompt_slots, window, device)
                         for g in prefill_groups(prompt_lengths, offsets)],
                        window, total)
    if decoded:
        allowed = visible(host[3 * decoded :], max(decode_positions) + 1, window)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        layout.decode_span, layout.decode_rows, layout.decode_bias = (lo, hi), rows, bias[:, None, None, :]
    return layout


class StepPacker:
    """Turns a scheduled step into its packed tokens [1, T], their layout and the positions whose
    logits are sampled. ``pad_to``: T is made a multiple of it (the sequence-parallel split) by a
    segment of padding tokens in ``scratch_slot``, a slot no row uses."""

    def __init__(self, prompts: torch.Tensor, lengths: list, pad_id: int, rotary: torch.Tensor, config, pad_to: int,
                 scratch_slot: int):
        self.prompts, self.lengths, self.pad_id, self.rotary = prompts, lengths, pad_id, rotary
        self.rope_factor = compat.rope_attention_factor(config)  # YaRN's, on the cosines and sines (else 1)
        self.pad_to, self.scratch_slot = pad_to, scratch_slot
        self.window = config.window_size[0] if config.window_size else None
        self.dtype, self.device = config.params_dtype, prompts.device

    def idle(self):
        """A step of padding into ``scratch_slot`` whose logits nobody reads: what a drained
        replica runs while its expert-parallel peers still generate (their all-to-alls need it)."""
        layout = pack_step([self.pad_to], [self.scratch_slot], [], [], self.rotary, self.window, self.dtype, self.device,
                           rope_factor=self.rope_factor)
        tokens = torch.full((1, self.pad_to), self.pad_id, dtype=torch.long, device=self.device)
        return tokens, layout, torch.zeros(1, dtype=torch.long, device=self.device)

    def pack(self, step: ScheduledStep, last_token: torch.Tensor):
        admitted_rows = step.rows[: len(step.admitted)]
        offsets = list(step.cached) or [0] * len(admitted_rows)
        prompt_lengths = [self.lengths[r] - o for r, o in zip(admitted_rows, offsets)]
        parts = [self.prompts[r, o : o + n] for r, o, n in zip(admitted_rows, offsets, prompt_lengths)]
        prompt_slots = list(step.admitted)
        keep, end = [], 0
        for n in prompt_lengths:
            end += n
            keep.append(end - 1)
        padding = -(end + len(step.decoding)) % self.pad_to
        if padding:  # a prompt of its own; its logits are not kept
            parts.append(torch.full((padding,), self.pad_id, dtype=torch.long, device=self.device))
            prompt_lengths.append(padding)
            prompt_slots.append(self.scratch_slot)
            offsets.append(0)
            end += padding
        layout = pack_step(prompt_lengths, prompt_slots, step.decoding, step.fed, self.rotary, self.window, self.dtype,
                           self.device, offsets, self.rope_factor)
        if step.decoding:  # each decoding slot's last token, at the slots the layout already holds
            parts.append(last_token.index_select(0, layout.slots[layout.decode_start :]))
            keep.extend(range(end, end + len(step.decoding)))
        return torch.cat(parts).unsqueeze(0), layout, torch.tensor(keep, device=self.device)
