"""An engine run that rows join at any time: multi-turn rollouts without lockstep.

generate() serves a batch known in advance. An open run serves rows added while it runs: a
trajectory whose turn ended goes to its environment while the engine decodes the others, and its
next turn joins the running batch when the reply comes (:meth:`OpenRun.add`); :meth:`OpenRun.step`
runs one engine step and returns the rows that ended. The KV cache is a session's
(generation/session.py): a slot freed by a trajectory is kept for it (taken last by a row with no
home), and its next turn feeds only the tokens after those the slot holds while no other row took
the slot. A row's n-th token is the n-th draw of its own stream, so its random numbers do not
depend on when it was added or next to which rows it ran. Its logits do, in their last bits: the
CPU's matrix kernels (MKL, oneDNN) compute a row differently with the count of rows beside it, so a
token near a tie (more often in bf16) and the behaviour log-probs can differ between schedules,
unless the run computes in batch-invariant arithmetic (trainer.batch_invariant,
models/batch_invariant.py): then they are the same bit for bit.
"""

from __future__ import annotations

import contextlib
from typing import Hashable, List, Optional, Sequence, Tuple

import torch

from megatron_rlhf.generation.generate import (PREFILL_TOKENS, EngineStats, EngineStep, Responses, _any_peer_running,
                                               _expert_parallel_peers, engine_modes, slot_cache)
from megatron_rlhf.generation.packing import StepPacker
from megatron_rlhf.generation.sampling import SamplingParams
from megatron_rlhf.generation.schedule import FREE, SlotSchedule
from megatron_rlhf.generation.session import CacheSession
from megatron_rlhf.models.decoder import groups_of, unwrap
from megatron_rlhf.runtime import megatron_compat as compat
from megatron_rlhf.runtime.platform import get_platform


class OpenRun:
    """Rows of ``model`` (every rank of its model-parallel group makes the same calls) sampled
    with ``params`` (its ``max_new_tokens`` unused: each row has its own limit) in the slots of
    ``session``; a context manager (the engine's modes held while it is open)."""

    def __init__(self, model: torch.nn.Module, params: SamplingParams, vocab_size: int, session: CacheSession,
                 completion_lag: Optional[int] = None, record_log_probs: bool = False):
        inner = unwrap(model)
        config = inner.config
        self.device = next(inner.parameters()).device
        self.session, self.params, self.model = session, params, model
        self.groups = groups_of(model)
        tp = self.groups.tp.size()
        platform = get_platform()
        self.lag = platform.completion_lag if completion_lag is None else completion_lag
        self.peers = _expert_parallel_peers(model)
        slots = session.slots
        self.schedule = SlotSchedule([], slots, [], PREFILL_TOKENS)
        self.schedule.keep_freed = True
        self.responses = Responses(torch.empty(0, 0, dtype=torch.long), [], slots, session.length, params, self.device,
                                   record_log_probs)
        self.packer = StepPacker(self.responses.tokens, self.schedule.lengths, params.pad_id,
                                 compat.rotary_angles(inner, session.length).to(self.device), config,
                                 pad_to=tp if config.sequence_parallel else 1, scratch_slot=slots)
        self.cache = session.cache_for(lambda: slot_cache(model, slots, session.length))
        self.stats = EngineStats()
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.core = EngineStep(None, self.packer, self.schedule, self.responses, empty, empty, params, vocab_size,
                               self.groups, slots, self.stats, record_log_probs)
        self.keys: List[Hashable] = []  # per row
        self._modes = contextlib.ExitStack()

    def __enter__(self) -> "OpenRun":
        self.core.stage = self._modes.enter_context(engine_modes(self.model, self.cache))
        self._modes.callback(self.core.release_graphs)
        return self

    def __exit__(self, *exc) -> None:
        self._modes.close()

    @property
    def busy(self) -> bool:
        """Whether a row waits for a slot or holds one."""
        return not self.schedule.drained

    def add(self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]], limits: Sequence[int],
            seeds: torch.Tensor) -> int:
        """Rows to sample: each its key (a trajectory's id), its tokens so far, how many to sample
        at most and its stream's seed (its draws counted from 0). How many of them feed only the
        tokens after those their slot holds."""
        if any(len(p) + n > self.session.length for p, n in zip(prompts, limits)):
            raise ValueError(f"a row's tokens plus its limit exceed the session's {self.session.length} positions")
        homes, cached = self.session.homes(keys, prompts)
        self.schedule.add([len(p) for p in prompts], list(limits), homes, cached)
        self.responses.add(prompts, self.params.pad_id)
        self.packer.prompts = self.responses.tokens
        self.core.seeds = torch.cat([self.core.seeds, seeds.to(self.device, torch.int64)])
        self.core.offsets = torch.cat([self.core.offsets, torch.zeros(len(prompts), dtype=torch.int64, device=self.device)])
        self.core.forget_graphs()  # they read the buffers just replaced
        self.keys += keys
        resumed = sum(n > 0 for n in cached)
        self.stats.resumed += resumed
        return resumed

    def release(self, key: Hashable) -> None:
        """``key`` will not come back: its slot is free to any row."""
        for slot, holder in enumerate(self.session.holder):
            if holder == key:
                self.schedule.reserved.discard(slot)

    def step(self, active: bool = True) -> Optional[List[Tuple[Hashable, List[int], Optional[List[float]]]]]:
        """One engine step if a row is ready; the rows that ended (key, the tokens sampled, and
        with ``record_log_probs`` the engine's log-prob of each).
        ``active``: whether this replica still has work (rows, or rows to come); with expert
        parallelism every peer runs a step while any is active, and None says none is."""
        step = self.schedule.next_step(self.lag)
        if self.peers is not None and not _any_peer_running(self.peers, active or step is not None, self.device):
            return None
        if step is not None:
            for slot in step.admitted:  # its cache is overwritten from here
                self.session.holder[slot], self.session.held[slot] = None, []
            self.core.run(step)
        elif self.peers is not None:  # nothing here: take part in the peers' expert all-to-alls
            self.core.stage.forward(*self.packer.idle())
        return self._ended()

    def _ended(self) -> List[Tuple[Hashable, List[int], Optional[List[float]]]]:
        ended, self.schedule.ended = self.schedule.ended, []
        if not ended:
            return []
        rows = torch.tensor([row for row, _ in ended], device=self.device)
        tokens = self.responses.tokens[rows].tolist()
        counts = self.responses.response_lengths[rows].tolist()
        log_probs = None if self.responses.log_probs is None else self.responses.log_probs[rows].tolist()
        self.stats.useful += sum(counts)
        out = []
        for i, ((row, slot), row_tokens, n) in enumerate(zip(ended, tokens, counts)):
            start = self.schedule.lengths[row]
            if self.schedule.row_in[slot] == FREE:  # not taken again at once: kept for the row's next turn
                self.session.holder[slot], self.session.held[slot] = self.keys[row], row_tokens[: start + n - 1]
            out.append((self.keys[row], row_tokens[start : start + n],
                        None if log_probs is None else log_probs[i][start : start + n]))
        return out
