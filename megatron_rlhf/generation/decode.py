"""The engine's decode step at fixed shapes.

A step that admits no prompt feeds one token for each decoding slot. Its shapes are fixed by two
buckets, not by which slots decode: it computes the first ``rows`` slots (the smallest power of
two that covers the highest decoding slot, at most every slot) with attention over the first
``extent`` positions of their caches (the longest row's positions rounded up to EXTENT_BUCKET). A
slot that does not decode this step computes a row that is dropped: its token goes to the scratch
slot's cache, its sample to the unkept column of response row 0. What changes between steps (per
slot: decoding or not, its cache position, its response row, the draws its stream gave) arrives in
one host-to-device copy into a buffer made once per generation call; everything after that copy is
device work on tensors of the bucket's shapes, with no value read back by the host: on CUDA that
is what a graph captures and replays per bucket; on CPU the same step runs eagerly.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_rlhf.generation.packing import StepLayout, rope_factors, visible
from megatron_rlhf.generation.schedule import ScheduledStep
from megatron_rlhf.runtime.platform import get_platform

# "off" runs every decode step eagerly on CUDA too (graphs are made where the platform captures them).
GRAPHS_VARIABLE = "MEGATRON_RLHF_DECODE_GRAPHS"
# Cache positions are read in multiples of this: a row's attention reads at most this many
# masked positions more, and a graph serves this many steps of the longest row.
EXTENT_BUCKET = 32
DECODING, POSITION, ROW, COUNTER = range(4)


def rows_bucket(highest_slot: int, slots: int) -> int:
    """Rows a decode step computes when its highest decoding slot is ``highest_slot``."""
    rows = 1
    while rows <= highest_slot:
        rows *= 2
    return min(rows, slots)


def extent_bucket(positions: int, length: int) -> int:
    """Cache positions a decode step reads when its longest row holds ``positions`` (its new token's included)."""
    return min(length, -(-positions // EXTENT_BUCKET) * EXTENT_BUCKET)


class DecodeInputs:
    """Per slot, what a decode step needs that changes between steps: [4, slots] int64 on the
    device (decoding 0/1, cache position, response row, draws so far), written by one copy."""

    def __init__(self, slots: int, device: torch.device):
        self.values = torch.zeros((4, slots), dtype=torch.long, device=device)
        self._copy = get_platform().staged_copy((4, slots), torch.long)

    def send(self, step: ScheduledStep, rows: int) -> torch.Tensor:
        """``step``'s values for the first ``rows`` slots (a slot not decoding: zeros) sent; their view."""
        host: List[List[int]] = [[0] * rows for _ in range(4)]
        for slot, row, counter, fed in zip(step.decoding, step.rows, step.counters, step.fed):  # nothing admitted
            host[DECODING][slot], host[POSITION][slot], host[ROW][slot], host[COUNTER][slot] = 1, fed, row, counter
        view = self.values[:, :rows]
        self._copy(torch.tensor(host, dtype=torch.long), view)
        return view


def decode_layout(positions: torch.Tensor, decoding: torch.Tensor, scratch_slot: int, rotary: torch.Tensor,
                  window, extent: int, dtype: torch.dtype, rope_factor: float = 1.0) -> StepLayout:
    """The layout of a decode step over slots 0..R-1 (``positions`` [R], ``decoding`` [R] bool):
    each slot's token at its position (a slot not decoding writes into ``scratch_slot``), attending
    to its positions so far within the first ``extent``. Device work only."""
    rows = positions.shape[0]
    slots = torch.where(decoding, torch.arange(rows, device=positions.device), scratch_slot)
    allowed = visible(positions, extent, window)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(~allowed, float("-inf"))
    return StepLayout(positions, slots, *rope_factors(rotary.index_select(0, positions), rope_factor, dtype), [], window, 0,
                      (0, rows), None, bias[:, None, None, :])


class DecodeGraphs:
    """CUDA graphs of the decode step, one per (rows, extent) bucket, in one memory pool: a bucket's
    first step runs eagerly (it is also the warm-up), then is captured; its later steps replay the
    capture, which reads the same device buffers (the inputs, the responses, the cache, the
    weights). Made for one engine call and released with it, before EMS can move the policy."""

    def __init__(self):
        self.graphs: Dict[Tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.pool_bytes = 0  # what the captures reserved (the allocator's count; no synchronisation)

    def run(self, bucket: Tuple[int, int], step: Callable[[], None]) -> None:
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        step()
        graph = torch.cuda.CUDAGraph()
        reserved = torch.cuda.memory_reserved()
        # Recorded, not run. Thread-local: work other threads queue meanwhile (a background
        # checkpoint's copies) is not the capture's business.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step()
        self.pool_bytes += torch.cuda.memory_reserved() - reserved
        self.graphs[bucket] = graph

    def clear(self) -> None:
        """Drop the captures (the buffers they read moved: rows joined an open run); the pool stays."""
        self.graphs.clear()

    def release(self) -> None:
        self.graphs.clear()
        self.pool = None


def graphs_wanted() -> bool:
    """MEGATRON_RLHF_DECODE_GRAPHS: on (the default) or off; any other value refused by name
    (start-up checks it, before any model is built)."""
    choice = os.environ.get(GRAPHS_VARIABLE, "on").strip().lower()
    if choice not in ("on", "off"):
        raise ValueError(f"{GRAPHS_VARIABLE}={os.environ[GRAPHS_VARIABLE]!r}: must be on or off (unset: on)")
    return choice == "on"


def decode_graphs() -> Optional[DecodeGraphs]:
    """Graphs for an engine call where the platform captures them and they are wanted."""
    return DecodeGraphs() if get_platform().captures_graphs and graphs_wanted() else None
