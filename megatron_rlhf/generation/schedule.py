"""The engine's host-side schedule: which row each decode slot holds, step by step.

Decided on the host from what every rank knows alike. A row leaves its slot when it has produced
``max_new_tokens`` (counted here) or emitted an end token, which the host learns from the device
``lag`` steps late (:meth:`SlotSchedule.learn_ended`); a freed slot takes the next waiting prompt
at the next step. Pure Python: no tensors, no devices.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Deque, List, Optional, Sequence, Tuple

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

    @property
    def slots(self) -> List[int]:
        return self.admitted + self.decoding


class SlotSchedule:
    """``slots`` decode slots serving rows of ``prompt_lengths`` in order.

    ``prefill_tokens``: prompt tokens admitted per step at most (the first prompt of a step is
    admitted whatever its length, so a long prompt still gets its prefill).
    """

    def __init__(self, prompt_lengths: Sequence[int], slots: int, max_new_tokens: int, prefill_tokens: int):
        self.lengths = list(prompt_lengths)
        self.max_new_tokens, self.prefill_tokens = max_new_tokens, prefill_tokens
        self.waiting: Deque[int] = collections.deque(range(len(self.lengths)))
        self.row_in = [FREE] * slots
        self.produced = [0] * slots  # tokens sampled for the slot's row so far
        self.fed = [0] * slots  # positions of the slot's row in the cache
        # (step, the row in each slot then, a function giving each slot's alive flag after that step)
        self._pending: Deque[Tuple[int, List[int], Callable[[], Sequence[bool]]]] = collections.deque()
        self.step = 0

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
                    self.row_in[slot] = FREE

    def next_step(self, lag: int = 0) -> Optional[ScheduledStep]:
        """Retire the rows that are done, admit waiting prompts to the free slots; the step to run,
        or None when every row is done."""
        for slot, row in enumerate(self.row_in):  # ended by length: known here
            if row != FREE and self.produced[slot] >= self.max_new_tokens:
                self.row_in[slot] = FREE
        self.learn_ended(lag)
        admitted = self._admit()
        decoding = [s for s, row in enumerate(self.row_in) if row != FREE and s not in admitted]
        if not admitted and not decoding:
            return None
        slots = admitted + decoding
        step = ScheduledStep(admitted, decoding, [self.row_in[s] for s in slots], [self.produced[s] for s in slots],
                             [self.fed[s] for s in decoding])
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
        for slot, row in enumerate(self.row_in):
            if row != FREE or not self.waiting:
                continue
            if admitted and self.lengths[self.waiting[0]] > budget:
                break
            row = self.waiting.popleft()
            self.row_in[slot], self.produced[slot], self.fed[slot] = row, 0, 0
            budget -= self.lengths[row]
            admitted.append(slot)
        return admitted
