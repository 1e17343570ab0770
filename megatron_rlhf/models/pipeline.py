"""Running a model through megatron's forward-backward schedule, so every call works under PP.

A micro-batch is a dict with ``tokens`` [b, s] (int64), optional ``position_ids`` [b, s] and
``attention_mask`` [b, 1, s, s] (bool, True = masked out; causal when absent), and whatever
else the loss function reads. All micro-batches of one call have the same b; s may differ from
one to the next (under PP the stages exchange each activation's shape first: megatron's
``variable_seq_lengths``, set on every model with PP > 1).

Under context parallelism each CP rank runs its share of every row's positions
(models/context_parallel.py): the model and the loss function read the rank's view of the
micro-batch; a forward-only result comes back whole, in sequence order, on every CP rank.

A model built with ``pack_rows`` runs each micro-batch's rows laid end to end without their padding
(models/packed_rows.py; the micro-batch says its rows' real lengths in ``ROW_LENGTHS``); the loss
function and ``reduce`` read the output in rows (an LM head read in chunks puts its per-token
results in rows itself).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron_rlhf.errors import NoGradientError
from megatron_rlhf.models import context_parallel, packed_rows, routing
from megatron_rlhf.models.batches import PACKED, ROW_LENGTHS, MicroBatch
from megatron_rlhf.models.decoder import global_rank, groups_of, unwrap
from megatron_rlhf.models.vocab_parallel import ChunkedLogits, chunked_lm_head
# loss_fn(output, micro_batch) -> (loss sum, count, metrics dict); output: [b, s, vocab/TP] or [b, s, 1]
# (ChunkedLogits for a function marked vocab_parallel.reads_chunked, on a model that chunks).
# Megatron's per-token loss path (calculate_per_token_loss, set on every model): the gradient is that
# of sum(loss sums) / sum(counts) over every micro-batch of the step on every DP rank (the count is
# all-reduced over DP and broadcast from the last pipeline stage before the grads are scaled by it).
LossFn = Callable[[torch.Tensor, MicroBatch], Tuple[torch.Tensor, torch.Tensor, Dict[str, Any]]]
# reduce(output, micro_batch) -> what a forward-only pass keeps of the output
Reduce = Callable[[torch.Tensor, MicroBatch], torch.Tensor]


def model_forward(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    packed = mb.get(PACKED)
    if packed is not None:
        return model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.params)
    tokens = mb["tokens"]
    position_ids = mb.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, position_ids, mb.get("attention_mask"))


def forward_backward(
    model: torch.nn.Module,
    micro_batches: List[MicroBatch],
    loss_fn: Optional[LossFn] = None,
    forward_only: bool = True,
    reduce: Optional[Reduce] = None,
    routes_out: Optional[List[torch.Tensor]] = None,
) -> List[Dict[str, Any]]:
    """Run every micro-batch through the model (forward, and backward unless ``forward_only``).

    Returns, on the last pipeline stage, one dict per micro-batch: the loss function's metrics, or
    without a loss function ``{"output": output}`` (detached), or ``reduce(output, micro_batch)``
    in its place when given (so full logits need not be kept). Other stages return ``[]``.
    Training gradients are those of (sum of the loss sums) / (sum of the counts) over every
    micro-batch on every DP rank (see LossFn), however the step is cut.

    A micro-batch with ``routes`` (models/routing.py) replays that routing in its forward; with
    ``routes_out`` (a list), each micro-batch's routing on this stage is appended to it, [b, s, L, K].

    Under context parallelism ``reduce`` sees this CP rank's view or the whole sequence (_kept).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    groups = groups_of(model)
    cp, packs = _cp_size(groups), packs_rows(model)
    _check_call(micro_batches, loss_fn, forward_only, routes_out, groups, packs)
    batch, seq = micro_batches[0]["tokens"].shape[0], max(mb["tokens"].shape[1] for mb in micro_batches)
    if packs:  # the model sees one row: its rows' real tokens
        batch, seq = 1, max(int(mb[ROW_LENGTHS].sum()) for mb in micro_batches)
    recording = routing.recording(model) if routes_out is not None else contextlib.nullcontext()

    def collect_output(output, mb: MicroBatch, view: MicroBatch):  # a loss's shape; nothing is trained
        zero = (output.hidden if isinstance(output, ChunkedLogits) else output).sum() * 0.0
        return zero, torch.ones((), dtype=torch.int), {"output": _kept(output, mb, view, reduce, groups)}

    reader = loss_fn or reduce
    trains = not forward_only and any(p.requires_grad for p in model.parameters())

    def call_loss(mb: MicroBatch, view: MicroBatch, chunked, output: torch.Tensor):
        # megatron calls loss_func(output); the micro-batch is bound first. Hand it a copy of the
        # loss, so metrics that share its storage (loss.detach()) keep the value whatever megatron
        # does to it in place.
        output = output if chunked is None else chunked(output)
        if loss_fn is None:
            return collect_output(output, mb, view)
        loss, count, metrics = loss_fn(*_in_rows(output, mb, view))
        return loss.clone(), count.to(torch.int), metrics

    def forward_step_func(data_iterator, model_chunk):
        mb = next(data_iterator)
        view = context_parallel.on_this_rank(mb, groups.cp) if cp > 1 else \
            packed_rows.packed(mb, _sequence_multiple(model_chunk), {routing.ROUTES: -1}) if packs else mb
        with routing.replaying(model_chunk, view.get(routing.ROUTES)), chunked_lm_head(model_chunk, reader) as chunked:
            output = model_forward(model_chunk, view)
        if trains and not output.requires_grad:  # megatron's backward would then skip it, and train nothing
            raise NoGradientError(f"pipeline stage {groups.pp.rank()}: the training pass's output needs no gradient, so "
                                  "none of the trained parameters before it would learn (a frozen block whose inputs "
                                  "need no gradient either, as under activation recompute?)")
        if routes_out is not None:
            dtype = routing.routes_dtype(unwrap(model_chunk).config.num_moe_experts)
            if packs:
                flat = routing.recorded(model_chunk, view[PACKED].tokens.numel())
                routes_out.append(view[PACKED].as_rows(flat.unsqueeze(0), fill=-1).to(dtype))
            else:
                flat = routing.recorded(model_chunk, mb["tokens"].numel())
                routes_out.append(routing.as_rows(flat, *mb["tokens"].shape, dtype))
        return output, partial(call_loss, mb, view, chunked)

    with recording:
        return get_forward_backward_func(pp_size=groups.pp.size())(
            forward_step_func=forward_step_func,
            data_iterator=iter(micro_batches),
            model=model,
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=forward_only,
            **_communicators(model, groups),
        )


def _check_call(micro_batches: List[MicroBatch], loss_fn, forward_only: bool, routes_out, groups, packs: bool) -> None:
    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    if loss_fn is None and not forward_only:
        raise ValueError("training (forward_only=False) needs a loss function")
    rows = [mb["tokens"].shape[0] for mb in micro_batches]
    if groups.pp.size() > 1 and len(set(rows)) > 1 and not packs:
        raise ValueError(f"under pipeline parallelism all micro-batches of one call need the same number of rows: {rows}")
    if _cp_size(groups) > 1 and routes_out is not None:
        raise ValueError("context parallelism: recording the experts' routing (routing replay) is not modelled over CP "
                         "ranks yet; set context_parallel_size 1 or turn routing replay off")
    if packs and _cp_size(groups) > 1:
        raise ValueError("packed rows beside context parallelism are not modelled yet: set pack_rows false or "
                         "context_parallel_size 1")
    if packs and any(ROW_LENGTHS not in mb for mb in micro_batches):
        raise ValueError(f"packed rows: every micro-batch needs its rows' real lengths ({ROW_LENGTHS!r})")


def _cp_size(groups) -> int:
    return groups.cp.size() if getattr(groups, "cp", None) is not None else 1


def packs_rows(model: torch.nn.Module) -> bool:
    """Whether ``model`` (built with pack_rows) runs its micro-batches' rows packed."""
    return getattr(unwrap(model), "pack_rows", False)


def _sequence_multiple(model: torch.nn.Module) -> int:
    """What a packed row's length must divide by: TP under sequence parallelism (its sequence is cut over TP)."""
    config = unwrap(model).config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _in_rows(output, mb: MicroBatch, view: MicroBatch):
    """(output, micro-batch) as a loss or reduce reads them: a packed pass's output put back in rows
    with the micro-batch itself, but an LM head's read in chunks with the packed view (at_actions
    puts its per-token results in rows); otherwise as they are."""
    if PACKED in view and not isinstance(output, ChunkedLogits):
        return view[PACKED].as_rows(output), mb
    return output, view


def _kept(output, mb: MicroBatch, view: MicroBatch, reduce: Optional[Reduce], groups):
    """What a forward-only pass keeps of a micro-batch's output: ``reduce(output, mb)``, or the
    output; a packed pass's in rows (_in_rows). Under context parallelism, on every CP rank: a reduce
    that reads an LM head's output (vocab_parallel.reads_chunked: a per-action result, [b, s-1, ...])
    runs on the rank's view and its results are gathered; another runs on the whole output gathered
    first (a scalar head's [b, s, 1]; whole logits only where no reduce is given)."""
    if _cp_size(groups) == 1:
        output, read = _in_rows(output, mb, view)
        return output.detach() if reduce is None else reduce(output, read)
    if reduce is not None and getattr(reduce, "reads_chunked", False):
        return context_parallel.whole_sequence(reduce(output, view), groups.cp, mb["tokens"].shape[1] - 1)
    whole = context_parallel.whole_sequence(output.detach(), groups.cp, mb["tokens"].shape[1])
    return whole if reduce is None else reduce(whole, mb)


def _communicators(model: torch.nn.Module, groups) -> Dict[str, Any]:
    """The schedule's process groups: the model's own (megatron's schedules read the global
    parallel_state unless given them; the pipelined one takes both or neither)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    if groups.pp.size() == 1:
        return {"pg_collection": groups}
    return {"pg_collection": groups, "p2p_communicator": P2PCommunicator(pp_group=groups.pp, config=unwrap(model).config)}


def gather_vocab_parallel(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """[..., vocab/TP] per rank -> [..., vocab] on every rank of ``tp_group`` (default: the run's
    TP group; for tests and tools, not training)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tp_group = tp_group or parallel_state.get_tensor_model_parallel_group()
    if tp_group.size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits, group=tp_group)


def sum_over(tensor: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks of ``group`` (a new tensor; the input is kept)."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return tensor
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    return total


def broadcast_from_last_stage(tensor, shape, dtype, device, pp_group) -> torch.Tensor:
    """A tensor computed on the last stage of ``pp_group`` (``tensor``; None elsewhere), on every stage."""
    import torch.distributed as dist

    if pp_group.size() == 1:
        return tensor
    tensor = torch.empty(shape, dtype=dtype, device=device) if tensor is None else tensor.contiguous()
    dist.broadcast(tensor, src=global_rank(pp_group, -1), group=pp_group)
    return tensor
