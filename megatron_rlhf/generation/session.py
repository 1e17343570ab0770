"""A KV cache kept across generate() calls: a trajectory's next turn feeds only its new tokens.

Each slot remembers whose tokens it holds (the caller's key for the row, e.g. a trajectory's id)
and which tokens: a row of a later call whose key a slot holds, and whose tokens begin with the
ones held, is served in that slot (its ``home``) and prefills only the rest. A row with no home (a
new trajectory, or one whose slot another took) prefills its whole prefix; its slot's previous
holder loses its cache then (continuous batching across turns: a free slot never waits for a
trajectory that may come back). Every rank of a replica makes the same decisions: they depend only
on the tokens and keys, which every rank has alike.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

from megatron_rlhf.generation.kv_cache import SlotKVCache


class CacheSession:
    """``slots`` decode slots of ``length`` positions kept between calls until :meth:`close`.
    ``on_cache(cache)``: a context manager held while the cache is allocated (the EMS ledger's
    record of it)."""

    def __init__(self, slots: int, length: int, on_cache: Optional[Callable[[SlotKVCache], object]] = None):
        if slots < 1 or length < 1:
            raise ValueError(f"a cache session needs slots and length >= 1, got {slots} and {length}")
        self.slots, self.length = slots, length
        self.cache: Optional[SlotKVCache] = None
        self.holder: List[Optional[Hashable]] = [None] * slots
        self.held: List[List[int]] = [[] for _ in range(slots)]  # the tokens whose keys and values are cached
        self._on_cache = on_cache
        self._holding = contextlib.ExitStack()

    def cache_for(self, make: Callable[[], SlotKVCache]) -> SlotKVCache:
        """The session's cache, made by ``make()`` on the first call."""
        if self.cache is None:
            self.cache = make()
            if self._on_cache is not None:
                self._holding.enter_context(self._on_cache(self.cache))
        return self.cache

    def homes(self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]]) -> Tuple[List[Optional[int]], List[int]]:
        """Per row: the slot holding the start of its tokens ``prompts[i]`` (None if none) and how
        many of them it holds (at most all but the last: a row feeds one token at least)."""
        where = {key: slot for slot, key in enumerate(self.holder) if key is not None}
        homes, cached = [], []
        for key, tokens in zip(keys, prompts):
            slot = where.get(key)
            held = self.held[slot] if slot is not None else []
            if slot is None or not held or len(held) >= len(tokens) or list(tokens[: len(held)]) != held:
                homes.append(None)
                cached.append(0)
            else:
                homes.append(slot)
                cached.append(len(held))
        return homes, cached

    def keep(self, served: Sequence[int], keys: Sequence[Hashable], rows: Sequence[Sequence[int]]) -> None:
        """After a call: slot s now holds the row ``served[s]`` (-1: unchanged), all of its tokens
        ``rows[row]`` but the last (sampled, never fed)."""
        for slot, row in enumerate(served):
            if row >= 0:
                self.holder[slot], self.held[slot] = keys[row], list(rows[row][:-1])

    def close(self) -> None:
        """Free the cache (and leave the ledger's record of it)."""
        self._holding.close()
        if self.cache is not None:
            self.cache.release()
            self.cache = None
        self.holder = [None] * self.slots
        self.held = [[] for _ in range(self.slots)]

    def __enter__(self) -> "CacheSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
