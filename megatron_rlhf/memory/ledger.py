"""The memory ledger: at every onload, offload, transient allocation (the KV cache) and phase end,
one record per role with the resident device bytes of each kind (counted from the tensors'
storages; ``resident_bytes`` sums the state kinds, ``transient_bytes`` the transient), the host
arenas' bytes and the bytes copied to them so far, plus the allocator's
figures on CUDA or the process RSS on CPU. Written as JSON lines to ``memory.jsonl``."""

from __future__ import annotations

import json
import os
import time
import warnings
from typing import Dict, List, Optional, Tuple

from megatron_rlhf.errors import RunError
from megatron_rlhf.memory.kinds import LEDGER_KINDS, TRANSIENT_KINDS
from megatron_rlhf.memory.manager import RoleMemory
from megatron_rlhf.runtime.platform import DevicePlatform, get_platform


# Device memory may grow this much between the same moments of two iterations before the guard
# speaks: one large allocator segment (CUDA rounds large blocks to 2 MiB; small ones live in 2 MiB
# segments too).
GROWTH_TOLERANCE = 2 * 2**20


class MemoryLeak(RunError):
    """Device memory that EMS should have released is still held (memory_guard: error)."""


class MemoryLeakWarning(UserWarning):
    pass


class MemoryLedger:
    def __init__(self, path: Optional[str] = None, platform: Optional[DevicePlatform] = None, guard: str = "warn"):
        """``path``: the JSONL file to append to (None: keep records in memory only). ``guard``:
        after every offload, check for device memory left behind ("warn", "error" or "off")."""
        if guard not in ("off", "warn", "error"):
            raise ValueError(f"guard must be off, warn or error, got {guard!r}")
        self.path = path
        self.guard = guard
        self.leaks: List[str] = []
        self._first_iteration: Dict[Tuple, Dict[str, int]] = {}  # (role, phase, n-th offload) -> device figures
        self._offloads_this_iteration: Dict[Tuple, int] = {}  # (role, phase) -> offloads so far
        self._counted_iteration = None
        self.platform = platform or get_platform()
        self.roles: Dict[str, RoleMemory] = {}
        self.records: List[dict] = []
        self.iteration = 0
        self.moments = 0  # record sets written so far; each record carries its set's number
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if os.path.exists(path):  # a resumed run appends: number its moments after the old ones
                self.moments = _last_moment(path) + 1

    def track(self, memory: RoleMemory) -> None:
        """Follow this role: its moves are recorded, and it appears in every record set."""
        self.roles[memory.name] = memory
        memory.on_event = self.record

    def record(self, event: str, phase: str, active_role: Optional[str] = None) -> List[dict]:
        """One record per tracked role for this moment (``event``: onload, offload, phase_end)."""
        stats = self.platform.memory_stats()
        now = time.time()
        records = []
        for name, memory in self.roles.items():
            by_kind = memory.resident_bytes()
            records.append(
                {
                    "moment": self.moments,
                    "iteration": self.iteration,
                    "phase": phase,
                    "event": event,
                    "active_role": active_role,
                    "role": name,
                    "bytes": by_kind,
                    "resident_bytes": sum(by_kind[k] for k in LEDGER_KINDS),
                    "transient_bytes": sum(by_kind[k] for k in TRANSIENT_KINDS),
                    "host_bytes": memory.host_bytes(),
                    "host_copied_bytes": memory.copied_bytes(),
                    "device": stats,
                    "time": now,
                }
            )
        self.moments += 1
        self.records.extend(records)
        if event == "offload" and active_role in self.roles and self.guard != "off":
            self._check(active_role, phase, stats)
        if self.path is not None:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.writelines(json.dumps(r) + "\n" for r in records)
            except OSError as e:  # a full disk: said as the run's one line, the checkpoints kept
                raise RunError(f"writing the memory ledger {self.path} failed: {e.strerror or e}; the last complete "
                               "checkpoint is kept (--resume continues from it once there is room)") from None
        return records

    def _check(self, role: str, phase: str, stats: Dict[str, int]) -> None:
        """The leak guard after ``role``'s offload: what its offloaded kinds still hold, and (where
        the allocator reports them) allocated and reserved bytes against the same moment of the
        first iteration the guard saw."""
        found = [f"{role}: {kind}: {held:,} bytes still on the device after its offload ({phase})"
                 for kind, held in self.roles[role].leftovers().items()]
        if self._counted_iteration != self.iteration:
            self._offloads_this_iteration, self._counted_iteration = {}, self.iteration
        key = (role, phase)
        nth = self._offloads_this_iteration[key] = self._offloads_this_iteration.get(key, 0) + 1
        moment = (role, phase, nth)
        figures = {k: stats[k] for k in ("allocated", "reserved") if k in stats}
        first = self._first_iteration.setdefault(moment, dict(figures, iteration=self.iteration))
        for name, value in figures.items():
            grown = value - first[name]
            if first["iteration"] != self.iteration and grown > GROWTH_TOLERANCE:
                found.append(f"{role}: {name} device memory after its offload ({phase}) grew by {grown:,} bytes "
                             f"since iteration {first['iteration']} ({first[name]:,} -> {value:,})")
        for problem in found:
            self.leaks.append(problem)
            if self.guard == "error":
                raise MemoryLeak(f"iteration {self.iteration}: EMS leak guard (trainer.memory_guard: error): {problem}; "
                                 "set trainer.memory_guard: warn to go on regardless")
            warnings.warn(f"EMS leak guard: {problem}", MemoryLeakWarning, stacklevel=3)

    def role_peak_bytes(self) -> Dict[str, int]:
        """Per role, the most of its state ever resident: what it would hold if it never left."""
        peaks: Dict[str, int] = {}
        for r in self.records:
            peaks[r["role"]] = max(peaks.get(r["role"], 0), r["resident_bytes"])
        return peaks

    def peak_resident_bytes(self) -> int:
        """The most role-state bytes resident at any recorded moment, summed over the roles."""
        totals: Dict[int, int] = {}
        for r in self.records:
            totals[r["moment"]] = totals.get(r["moment"], 0) + r["resident_bytes"]
        return max(totals.values(), default=0)


def _last_moment(path: str) -> int:
    """The moment of the last whole record of a ledger file (-1 for none): a torn last line, what a
    full disk or a kill leaves, is passed over (the resume cuts it back)."""
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("moment", -1))
        except (ValueError, AttributeError):
            continue
    return -1
