"""The engine's host-side schedule: which row each decode slot holds, step by step.

Decided on the host from what every rank knows alike. A row leaves its slot when it has produced
its ``max_new_tokens`` (counted here) or emitted an end token, which the host learns from the device
``lag`` steps late (:meth:`SlotSchedule.learn_ended`); a freed slot takes the next waiting prompt
at the next step. A row whose prefix a slot's cache already holds (a trajectory's next turn,
generation/session.py) waits for that slot, its ``home``, and feeds only the tokens after the
cached ones; a row with no home takes a free slot no waiting row calls home. Pure Python: no
tensors, no devices.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Deque, List, Optional, Sequence, Set, Tuple, Union

FREE = -1


@dataclasses.dataclass
class ScheduledStep:
    """One engine step: the slots admitted (whole prompt fed), then the slots decoding (one token).

    rows: the row of each of ``admitted + decoding``, in that order; counters: how many tokens each
    had sampled before this step (the index of the draw it takes now); fed: the positions of each
    decoding row already in the cache (its token goes there).
    """

    admitted: List[int]
    decoding: List[int]
    rows: List[int]
    counters: List[int]
    fed: List[int]
    cached: List[int] = dataclasses.field(default_factory=list)  # per admitted slot: prefix positions already cached

    @property
    def slots(self) -> List[int]:
        return self.admitted + self.decoding


class SlotSchedule:
    """``slots`` decode slots serving rows of ``prompt_lengths`` in order.

    ``max_new_tokens``: each row's limit (or one for all). ``prefill_tokens``: prompt tokens
    admitted per step at most (the first prompt of a step is admitted whatever its length, so a long
    prompt still gets its prefill). ``homes``: per row, the slot whose cache holds its first
    ``cached`` tokens, or None.
    """

    def __init__(self, prompt_lengths: Sequence[int], slots: int, max_new_tokens: Union[int, Sequence[int]],
                 prefill_tokens: int, homes: Optional[Sequence[Optional[int]]] = None,
                 cached: Optional[Sequence[int]] = None):
        self.lengths = list(prompt_lengths)
        rows = len(self.lengths)
        self.limits = [max_new_tokens] * rows if isinstance(max_new_tokens, int) else list(max_new_tokens)
        self.prefill_tokens = prefill_tokens
        self.homes = list(homes) if homes is not None else [None] * rows
        self.cached = list(cached) if cached is not None else [0] * rows
        self.waiting: Deque[int] = collections.deque(range(rows))
        self.served = [FREE] * slots  # the last row each slot held (whose tokens its cache keeps)
        self.row_in = [FREE] * slots
        self.produced = [0] * slots  # tokens sampled for the slot's row so far
        self.fed = [0] * slots  # positions of the slot's row in the cache
        # (step, the row in each slot then, a function giving each slot's alive flag after that step)
        self._pending: Deque[Tuple[int, List[int], Callable[[], Sequence[bool]]]] = collections.deque()
        self.step = 0
        self.ended: List[Tuple[int, int]] = []  # (row, slot) of each row that left its slot, in order
        # Free slots a homeless row takes last: their caches hold trajectories expected back
        # (with ``keep_freed``, every slot its row left is, until the owner says otherwise).
        self.reserved: Set[int] = set()
        self.keep_freed = False

    def add(self, lengths: Sequence[int], limits: Sequence[int], homes: Sequence[Optional[int]],
            cached: Sequence[int]) -> None:
        """More rows, waiting after the others (an open engine run)."""
        first = len(self.lengths)
        self.lengths += lengths
        self.limits += limits
        self.homes += homes
        self.cached += cached
        self.waiting.extend(range(first, len(self.lengths)))

    def _free(self, slot: int) -> None:
        self.ended.append((self.row_in[slot], slot))
        self.row_in[slot] = FREE
        if self.keep_freed:
            self.reserved.add(slot)

    @property
    def drained(self) -> bool:
        """No row waits and no slot holds one."""
        return not self.waiting and all(r == FREE for r in self.row_in)

    def note_alive(self, flags: Callable[[], Sequence[bool]]) -> None:
        """After a step: ``flags()`` will give each slot's alive flag (False once its row emitted an
        end token); it is read ``lag`` steps later by :meth:`learn_ended`."""
        self._pending.append((self.step - 1, list(self.row_in), flags))

    def learn_ended(self, lag: int) -> None:
        """Free the slots whose rows ended by an end token, as far as flags ``lag`` steps old tell."""
        while self._pending and self._pending[0][0] <= self.step - lag:
            _, held, flags = self._pending.popleft()
            for slot, alive in enumerate(flags()):
                if not alive and self.row_in[slot] == held[slot] != FREE:
                    self._free(slot)

    def next_step(self, lag: int = 0) -> Optional[ScheduledStep]:
        """Retire the rows that are done, admit waiting prompts to the free slots; the step to run,
        or None when every row is done."""
        for slot, row in enumerate(self.row_in):  # ended by length: known here
            if row != FREE and self.produced[slot] >= self.limits[row]:
                self._free(slot)
        self.learn_ended(lag)
        admitted = self._admit()
        decoding = [s for s, row in enumerate(self.row_in) if row != FREE and s not in admitted]
        if not admitted and not decoding:
            return None
        slots = admitted + decoding
        step = ScheduledStep(admitted, decoding, [self.row_in[s] for s in slots], [self.produced[s] for s in slots],
                             [self.fed[s] for s in decoding], [self.cached[self.row_in[s]] for s in admitted])
        for slot in admitted:
            self.fed[slot] = self.lengths[self.row_in[slot]]
        for slot in decoding:
            self.fed[slot] += 1
        for slot in slots:
            self.produced[slot] += 1
        self.step += 1
        return step

    def _admit(self) -> List[int]:
        admitted, budget = [], self.prefill_tokens
        called_home = {self.homes[r] for r in self.waiting} - {None}
        free = [slot for slot, row in enumerate(self.row_in) if row == FREE]
        for slot in sorted(free, key=lambda slot: slot in self.reserved):  # reserved slots last
            if not self.waiting:
                break
            row = self._waiting_for(slot, called_home)
            if row is None:
                continue
            if admitted and self.lengths[row] - self.cached[row] > budget:
                break
            self.waiting.remove(row)
            self.reserved.discard(slot)
            self.row_in[slot], self.served[slot], self.produced[slot], self.fed[slot] = row, row, 0, 0
            budget -= self.lengths[row] - self.cached[row]
            admitted.append(slot)
        return admitted

    def _waiting_for(self, slot: int, called_home: set) -> Optional[int]:
        """The waiting row that ``slot`` takes next: the one whose home it is, else (a slot no
        waiting row calls home) the first row without a home."""
        if slot in called_home:
            return next(r for r in self.waiting if self.homes[r] == slot)
        return next((r for r in self.waiting if self.homes[r] is None), None)
