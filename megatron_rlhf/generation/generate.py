"""Generation from a Megatron policy under TP and PP: a continuous-batching engine.

A fixed number of decode slots each hold one row at a time (schedule.py). A step that admits
prompts is one forward of a packed sequence (packing.py, stage.py): the whole prompt of each row
admitted, then the last token of every decoding row (kv_cache.py); a step that admits none runs at
fixed shapes, its inputs in one copy, then device work only (decode.py). When a row ends (EOS or max_new_tokens) its
slot takes the next waiting prompt, so no slot idles while prompts wait and no token is computed
for padding. With a cache session (session.py) the cache outlives the call: a trajectory's next
turn prefills only the tokens its slot does not hold yet.

The schedule is decided on the host from what every rank knows alike: lengths are counted there,
and EOS is learnt from the device ``completion_lag`` steps late (a copy started right after each
step is read ``lag`` steps later), so on CUDA the host never waits for the step it just queued; a
row that ended meanwhile computes a few tokens that are not kept. A row's random numbers do not
depend on the schedule: its n-th token is the n-th draw of its own stream (sampling.py); its
logits move in their last bits with the rows that share a step (the kernels' arithmetic). The last
stage samples from the TP-gathered logits; the tokens go to every TP rank and every stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Hashable, Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rlhf.generation.decode import (COUNTER, DECODING, POSITION, ROW, DecodeGraphs, DecodeInputs, decode_graphs,
                                             decode_layout, extent_bucket, rows_bucket)
from megatron_rlhf.generation.kv_cache import SlotKVCache
from megatron_rlhf.generation.packing import StepPacker
from megatron_rlhf.generation.sampling import SamplingParams, chosen_log_probs, sample_next
from megatron_rlhf.generation.schedule import ScheduledStep, SlotSchedule
from megatron_rlhf.generation.session import CacheSession
from megatron_rlhf.generation.stage import PipelineStage
from megatron_rlhf.models import batch_invariant, routing
from megatron_rlhf.models.batches import action_mask
from megatron_rlhf.models.decoder import global_rank, groups_of, unwrap
from megatron_rlhf.models.pipeline import broadcast_from_last_stage
from megatron_rlhf.models.vocab_parallel import token_log_probs
from megatron_rlhf.runtime import megatron_compat as compat
from megatron_rlhf.runtime.platform import get_platform

# Prompt tokens admitted per step at most (a longer prompt still gets its one prefill, alone):
# bounds a step's activations, as vLLM's max_num_batched_tokens does.
PREFILL_TOKENS = 8192


@dataclasses.dataclass
class EngineStats:
    """forward_passes: engine steps; computed_tokens: tokens fed (prompts + decode tokens);
    sampled: tokens sampled (one per prefill and per decode token); useful: tokens kept in a
    response; slot_steps: slots x steps (idle slots included); resumed: rows that fed only the
    tokens after those a cache session held for them; bucket_rows: rows decode steps computed for
    slots not decoding (their shapes' bucket, decode.py)."""

    forward_passes: int = 0
    computed_tokens: int = 0
    sampled: int = 0
    useful: int = 0
    slot_steps: int = 0
    resumed: int = 0
    bucket_rows: int = 0
    graph_replays: int = 0  # decode steps replayed from a CUDA graph (decode.py)
    graph_pool_bytes: int = 0  # the most the graphs' memory pool reserved in one engine call

    def count(self, step: ScheduledStep, fed: int, slots: int) -> None:
        self.forward_passes += 1
        self.computed_tokens += fed
        self.sampled += len(step.rows)
        self.slot_steps += slots


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
    routes: Optional[torch.Tensor] = None  # [B, S, L, K] when recorded (models/routing.py)
    # [B, S-1] per action when recorded: the log-prob the engine gave each response token it
    # sampled (the behaviour policy's, sampling.chosen_log_probs), 0 elsewhere.
    log_probs: Optional[torch.Tensor] = None

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


def _decided_once(sampled: torch.Tensor, tp_group) -> torch.Tensor:
    """The TP group's first rank's samples on every TP rank: the ranks can never disagree on a
    token (and so on when a row is done), whatever their kernels do."""
    if tp_group.size() > 1:
        dist.broadcast(sampled, src=global_rank(tp_group, 0), group=tp_group)
    return sampled


def _expert_parallel_peers(model):
    """The expert-parallel group when this model's experts are split over replicas (each replica
    generates its own rows, but every forward's experts exchange tokens with the same peers), else None."""
    ep = groups_of(model).ep
    if not getattr(unwrap(model).config, "num_moe_experts", None) or ep is None or ep.size() == 1:
        return None
    return ep


def _any_peer_running(peers, running: bool, device: torch.device) -> bool:
    """Whether this rank (``running``) or any expert-parallel peer still has a step to run: one small
    all-reduce per step, taken only with expert parallelism, so all peers run as many forwards."""
    flag = torch.tensor([int(running)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=peers)
    return bool(flag.item())


class Responses:
    """The rows being generated, on the device: tokens [B, width + 1] (prompt, then response; the
    last column takes the tokens not kept), each row's response length so far, and per slot its
    last token and whether its row is still going (no end token emitted); with ``log_probs``,
    the engine's log-prob of each token sampled, by position."""

    def __init__(self, prompts: torch.Tensor, lengths: list, slots: int, width: int, params: SamplingParams,
                 device: torch.device, log_probs: bool = False):
        rows = prompts.shape[0]
        self.width = width
        self.tokens = torch.full((rows, width + 1), params.pad_id, dtype=torch.long, device=device)
        self.tokens[:, : min(prompts.shape[1], width)] = prompts[:, :width]  # a wider prompt tensor holds padding there
        self.prompt_lengths = torch.tensor(lengths, dtype=torch.long, device=device)
        self.response_lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.alive = torch.zeros(slots, dtype=torch.bool, device=device)
        self.last_token = torch.zeros(slots, dtype=torch.long, device=device)
        self.eos_ids = torch.tensor(params.eos_ids, dtype=torch.long, device=device) if params.eos_ids else None
        self.log_probs = torch.zeros((rows, width + 1), device=device) if log_probs else None

    def add(self, prompts: Sequence[Sequence[int]], pad_id: int) -> None:
        """Rows joining an open run (generation/open_run.py): their prompts, nothing sampled yet."""
        device = self.tokens.device
        rows = torch.full((len(prompts), self.width + 1), pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            rows[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.tokens = torch.cat([self.tokens, rows.to(device)])
        self.prompt_lengths = torch.cat([self.prompt_lengths, torch.tensor([len(p) for p in prompts], device=device)])
        self.response_lengths = torch.cat([self.response_lengths, torch.zeros(len(prompts), dtype=torch.long, device=device)])
        if self.log_probs is not None:
            self.log_probs = torch.cat([self.log_probs, torch.zeros((len(prompts), self.width + 1), device=device)])

    def record(self, step: ScheduledStep, sampled: torch.Tensor, rows: torch.Tensor, counters: torch.Tensor,
               log_probs: Optional[torch.Tensor] = None) -> None:
        """Each slot's token of ``step`` (and its log-prob): kept where its row is still going."""
        slots = torch.tensor(step.slots, device=sampled.device)
        self.alive[slots[: len(step.admitted)]] = True
        self._record(slots, self.alive[slots], sampled, rows, counters, log_probs)

    def record_decode(self, inputs: torch.Tensor, sampled: torch.Tensor, log_probs: Optional[torch.Tensor]) -> None:
        """The tokens of a decode step over slots 0..R-1 (``inputs`` [4, R]: decode.DecodeInputs's
        view): kept where the slot decodes and its row is still going. Device work only."""
        rows = inputs.shape[1]
        kept = self.alive[:rows] & inputs[DECODING].bool()
        self._record(slice(0, rows), kept, sampled, inputs[ROW], inputs[COUNTER], log_probs)

    def _record(self, slots, kept: torch.Tensor, sampled: torch.Tensor, rows: torch.Tensor, counters: torch.Tensor,
                log_probs: Optional[torch.Tensor]) -> None:
        # A token not kept goes to the last column (rows of no response: response row 0's).
        where = torch.where(kept, self.prompt_lengths[rows] + counters, self.width)
        self.tokens[rows, where] = sampled
        if self.log_probs is not None:
            self.log_probs[rows, where] = log_probs
        self.response_lengths.index_add_(0, rows, kept.long())
        if self.eos_ids is not None:
            self.alive[slots] = kept & ~torch.isin(sampled, self.eos_ids)
        self.last_token[slots] = sampled

    def result(self, stats: EngineStats, routes: Optional["_Routes"]) -> Generated:
        stats.useful = int(self.response_lengths.sum())
        total = self.prompt_lengths + self.response_lengths
        used = int(total.max())
        # The token at position p is the action at p - 1's.
        log_probs = None if self.log_probs is None else self.log_probs[:, 1:used]
        return Generated(self.tokens[:, :used], self.prompt_lengths, self.response_lengths, stats,
                         None if routes is None else routes.result(total, used), log_probs)


class _Routes:
    """Routing replay's record of generation (models/routing.py): the experts of every token fed,
    by row and position, [B, width, L, K] (-1 where none). Written on the device without a host
    sync: tokens of no row (padding, the scratch slot) go to a spare last row."""

    def __init__(self, model: torch.nn.Module, rows: int, width: int, slots: int, device: torch.device):
        config = unwrap(model).config
        self.model = model
        self.table = torch.full((rows + 1, width, len(routing.routers(model)), config.moe_router_topk), -1,
                                dtype=routing.routes_dtype(config.num_moe_experts), device=device)
        self.slot_rows = torch.full((slots + 1,), rows, dtype=torch.long, device=device)  # the scratch slot: the spare row

    def write(self, step: ScheduledStep, step_rows: torch.Tensor, layout) -> None:
        """The routing of the step just run (``step_rows`` [len(step.slots)]: each slot's row)."""
        self.slot_rows[torch.tensor(step.slots, device=self.table.device)] = step_rows
        routes = routing.recorded(self.model, len(layout.positions))
        self.table[self.slot_rows[layout.slots], layout.positions] = routes.to(self.table.dtype)

    def result(self, total_lengths: torch.Tensor, used: int) -> torch.Tensor:
        """[B, used, L, K]; -1 past each row's end (tokens fed after an end the host learnt late)."""
        table = self.table[:-1, :used]
        beyond = torch.arange(used, device=table.device)[None, :] >= total_lengths[:, None]
        return table.masked_fill(beyond[:, :, None, None], -1)


def slot_cache(model: torch.nn.Module, slots: int, length: int) -> SlotKVCache:
    """The KV cache of ``slots`` decode slots of ``length`` positions for this rank's layers and
    heads, and one slot more, the scratch slot: where tokens of no row go (the decode step's slots
    not decoding, padding under sequence parallelism, idle steps under expert parallelism)."""
    inner = unwrap(model)
    config, tp = inner.config, groups_of(model).tp.size()
    if batch_invariant.enabled():  # whole key blocks per slot: the attention then never copies one
        length = batch_invariant.whole_blocks(length)
    return SlotKVCache(len(compat.attention_layers(inner)), slots + 1, length,
                       (config.num_query_groups or config.num_attention_heads) // tp, config.kv_channels,
                       config.params_dtype, next(inner.parameters()).device)


@contextlib.contextmanager
def engine_modes(model: torch.nn.Module, cache: SlotKVCache):
    """The model as the engine runs it: eval mode, its pipeline stage over ``cache`` (yielded),
    plain tensor ops, the engine's linears, inference mode; all undone on leaving."""
    with contextlib.ExitStack() as stack:
        stack.callback(model.train, model.training)
        model.eval()
        stage = stack.enter_context(PipelineStage(model, cache))
        platform = get_platform()
        stack.enter_context(platform.plain_tensor_ops())
        # Batch-invariant mode: its own linears (the trainer's), each weight packed once for the call.
        stack.enter_context(batch_invariant.fixed_weights() if batch_invariant.enabled() else platform.engine_linears(model))
        stack.enter_context(torch.inference_mode())
        yield stage


@dataclasses.dataclass
class EngineStep:
    """What one scheduled step needs: it packs the step, runs the forward, samples each row's
    token from its own stream (``seeds`` and ``offsets`` by row), records it and tells the
    schedule which rows are still going."""

    stage: PipelineStage
    packer: StepPacker
    schedule: SlotSchedule
    responses: "Responses"
    seeds: torch.Tensor
    offsets: torch.Tensor
    params: SamplingParams
    vocab_size: int
    groups: object
    slots: int
    stats: EngineStats
    record_log_probs: bool = False
    routes: Optional["_Routes"] = None
    decode_inputs: Optional[DecodeInputs] = None  # made at the first decode step
    graphs: Optional[DecodeGraphs] = None  # CUDA graphs of decode steps (decode.py), made with decode_inputs

    def run(self, step: ScheduledStep) -> None:
        # A step that admits no prompt runs at the decode step's fixed shapes (decode.py); one
        # that does, as one packed sequence. Under sequence parallelism or while routes are
        # recorded every step is packed (a decode step's rows are not a multiple of TP, and its
        # slots not decoding would record routes).
        if not step.admitted and self.packer.pad_to == 1 and self.routes is None:
            fed = self._run_decode(step)
        else:
            fed = self._run_packed(step)
        if self.params.eos_ids:
            copied = get_platform().copy_to_host_async(self.responses.alive)
            self.schedule.note_alive(lambda: copied().tolist())
        self.stats.count(step, fed, self.slots)

    def _run_packed(self, step: ScheduledStep) -> int:
        tokens, layout, keep = self.packer.pack(step, self.responses.last_token)
        logits = self.stage.forward(tokens, layout, keep)
        step_rows = torch.tensor(step.rows, device=self.seeds.device)
        if self.routes is not None:
            self.routes.write(step, step_rows, layout)
        counters = torch.tensor(step.counters, device=self.seeds.device)
        sampled, chosen = self._sample(logits, step_rows, counters)
        self.responses.record(step, sampled, step_rows, counters, chosen)
        return tokens.shape[1]

    def _run_decode(self, step: ScheduledStep) -> int:
        if self.decode_inputs is None:  # the call's first decode step
            self.decode_inputs, self.graphs = DecodeInputs(self.slots, self.seeds.device), decode_graphs()
        rows = rows_bucket(max(step.decoding), self.slots)
        extent = extent_bucket(max(step.fed) + 1, self.stage.cache.length)
        inputs = self.decode_inputs.send(step, rows)
        if self.graphs is None:
            self._decode_on_device(inputs, extent)
        else:
            self.graphs.run((rows, extent), lambda: self._decode_on_device(inputs, extent))
        self.stats.bucket_rows += rows - len(step.decoding)
        return len(step.decoding)

    def _decode_on_device(self, inputs: torch.Tensor, extent: int) -> None:
        """A decode step after its inputs' copy: device work of the bucket's shapes only."""
        packer, rows = self.packer, inputs.shape[1]
        layout = decode_layout(inputs[POSITION], inputs[DECODING].bool(), packer.scratch_slot, packer.rotary,
                               packer.window, extent, packer.dtype, packer.rope_factor)
        logits = self.stage.forward(self.responses.last_token[:rows].unsqueeze(0), layout, None)
        sampled, chosen = self._sample(logits, inputs[ROW], inputs[COUNTER])
        self.responses.record_decode(inputs, sampled, chosen)

    def forget_graphs(self) -> None:
        """The buffers the graphs read moved (rows joined an open run): capture again."""
        if self.graphs is not None:
            self.graphs.clear()

    def release_graphs(self) -> None:
        if self.graphs is not None:
            self.stats.graph_replays += self.graphs.replays
            self.stats.graph_pool_bytes = max(self.stats.graph_pool_bytes, self.graphs.pool_bytes)
            self.graphs.release()
            self.graphs = None

    def _sample(self, logits: Optional[torch.Tensor], rows: torch.Tensor, counters: torch.Tensor):
        """Each row's token (``rows`` [N]: their response rows, ``counters`` [N]: the draws each
        stream gave so far) from the last stage's logits [N, V], and with ``record_log_probs``
        its log-prob; on every rank."""
        device, n = rows.device, rows.shape[0]
        sampled = chosen = None
        if logits is not None:
            padded, logits = logits, logits[:, : self.vocab_size]
            sampled = _decided_once(sample_next(logits, self.params, self.seeds[rows], counters + self.offsets[rows]),
                                    self.groups.tp)
            if self.record_log_probs and batch_invariant.enabled():  # the trainer's own function, exactly
                chosen = token_log_probs(padded, sampled, self.vocab_size, self.params.temperature, self.groups.tp)
            elif self.record_log_probs:
                chosen = _decided_once(chosen_log_probs(logits, sampled, self.params.temperature), self.groups.tp)
        if self.record_log_probs:
            chosen = broadcast_from_last_stage(chosen, (n,), torch.float32, device, self.groups.pp)
        return broadcast_from_last_stage(sampled, (n,), torch.long, device, self.groups.pp), chosen


def _checked_request(prompts, prompt_lengths, params, max_new_tokens, session, keys, record_routes, start_counters):
    """generate()'s arguments checked: each row's prompt length, token limit and start counter."""
    if prompts.dim() != 2 or prompt_lengths.shape != prompts.shape[:1]:
        raise ValueError(f"prompts must be [B, P] with prompt_lengths [B], got {tuple(prompts.shape)} and {tuple(prompt_lengths.shape)}")
    rows = prompts.shape[0]
    lengths = [int(n) for n in prompt_lengths.tolist()]
    if rows == 0 or min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    limits = [params.max_new_tokens] * rows if max_new_tokens is None else [int(n) for n in max_new_tokens]
    if len(limits) != rows or min(limits) < 1:
        raise ValueError(f"max_new_tokens needs one limit >= 1 per row, got {limits}")
    if session is not None and (keys is None or len(keys) != rows or record_routes):
        raise ValueError("a cache session needs one key per row and cannot record routes")
    offsets = [0] * rows if start_counters is None else [int(n) for n in start_counters]
    if len(offsets) != rows or min(offsets) < 0:
        raise ValueError(f"start_counters needs one count >= 0 per row, got {start_counters}")
    return lengths, limits, offsets


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
    record_routes: bool = False,
    max_new_tokens: Optional[Sequence[int]] = None,
    session: Optional[CacheSession] = None,
    keys: Optional[Sequence[Hashable]] = None,
    start_counters: Optional[Sequence[int]] = None,
    record_log_probs: bool = False,
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
    it is released (the EMS ledger's record of it). ``record_routes``: the result carries the
    experts each fed token was routed to (routing replay's ``rollout`` record; a model with experts).
    ``max_new_tokens`` [B]: each row's own limit (default: ``params.max_new_tokens``).
    ``session``: a KV cache kept across calls (session.py; its slots and length replace
    ``batch_size`` and ``cache_length``, ``on_cache`` is the session's); ``keys`` [B]: each row's
    identity in it (a trajectory's id): a row whose earlier tokens the session holds feeds only
    the rest. ``start_counters`` [B]: the draws each row's stream has already given (a response
    resumed after that many tokens draws on from there; default 0). ``record_log_probs``: the
    result carries the engine's log-prob of each token it sampled (``Generated.log_probs``).
    """
    # One call reads top to bottom: the request checked, the engine set up, the step loop, the
    # session's bookkeeping; its parts are the classes it drives (schedule, packer, responses).
    lengths, limits, offsets = _checked_request(prompts, prompt_lengths, params, max_new_tokens, session, keys,
                                                record_routes, start_counters)
    rows = len(lengths)
    inner = unwrap(model)
    config = inner.config
    device = next(inner.parameters()).device
    slots = session.slots if session is not None else min(rows, batch_size or rows)
    width = max(n + limit for n, limit in zip(lengths, limits))  # the longest row
    cache_length = session.length if session is not None else cache_length or width
    if cache_length < width:
        raise ValueError(f"cache_length {cache_length} < the longest prompt plus its max_new_tokens ({width})")
    platform = get_platform()
    lag = platform.completion_lag if completion_lag is None else completion_lag
    groups = groups_of(model)
    tp = groups.tp.size()
    packer = StepPacker(right_pad(prompts.to(device), prompt_lengths.to(device), params.pad_id, padding_side), lengths, params.pad_id,
                     compat.rotary_angles(inner, cache_length).to(device), config, pad_to=tp if config.sequence_parallel else 1,
                     scratch_slot=slots)
    seeds = (torch.arange(rows) if seeds is None else seeds).to(device=device, dtype=torch.int64)
    offsets = torch.tensor(offsets, dtype=torch.int64, device=device)
    homes, cached = None, None
    if session is not None:
        homes, cached = session.homes(keys, [p[:n] for p, n in zip(packer.prompts.tolist(), lengths)])
    schedule = SlotSchedule(lengths, slots, limits, PREFILL_TOKENS, homes, cached)
    responses = Responses(packer.prompts, lengths, slots, width, params, device, record_log_probs)
    peers = _expert_parallel_peers(model)

    def new_cache() -> SlotKVCache:
        return slot_cache(model, slots, cache_length)

    cache = session.cache_for(new_cache) if session is not None else new_cache()
    stats = EngineStats(resumed=sum(n > 0 for n in cached or []))
    routes = _Routes(model, rows, width, slots, device) if record_routes else None
    with contextlib.ExitStack() as stack:  # left in reverse: modes, stage, train mode, cache freed, on_cache
        if session is None:  # a session's cache outlives the call
            if on_cache is not None:
                stack.enter_context(on_cache(cache))
            stack.callback(cache.release)
        stage = stack.enter_context(engine_modes(model, cache))
        if routes is not None:
            stack.enter_context(routing.recording(model))
        core = EngineStep(stage, packer, schedule, responses, seeds, offsets, params, vocab_size, groups, slots,
                          stats, record_log_probs, routes)
        stack.callback(core.release_graphs)  # before the cache is released and the modes undone
        while (step := schedule.next_step(lag)) is not None or peers is not None:
            if peers is not None and not _any_peer_running(peers, step is not None, device):
                break
            if step is None:  # drained: take part in the peers' expert all-to-alls until they are too
                stage.forward(*packer.idle())
                continue
            core.run(step)
    generated = responses.result(stats, routes)
    if session is not None:
        totals = generated.total_lengths.tolist()
        session.keep(schedule.served, keys, [row[:n] for row, n in zip(generated.tokens.tolist(), totals)])
    return generated
