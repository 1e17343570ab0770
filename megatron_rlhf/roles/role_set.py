"""The run's roles on this rank, and where each runs: built and tracked by the EMS ledger, each
with the cut of the rollout its layout holds, brought onto the device for a phase (the next role's
onload overlapped where the planner says both fit), served the trained weights after training,
and the record of where this rank is (a rank that times out in a collective names the others).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Callable, Dict, Optional

import torch.distributed as dist

from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.models.decoder import groups_of
from megatron_rlhf.roles.base import Role, build_role
from megatron_rlhf.roles.weight_sync import WeightSync
from megatron_rlhf.roles.rows import RowCut, SampleRows, recut, trimmed


class Progress:
    """Where this rank is (iteration, phase, since when; its host and pid): one small file per rank
    under ``directory`` when given, read by train.py when a collective fails."""

    def __init__(self, directory: Optional[str] = None):
        self.directory = directory
        self.iteration = 0
        self.phase = ""
        self.mark("start-up")

    def mark(self, phase: str) -> None:
        self.phase = phase
        if self.directory is not None:
            with open(os.path.join(self.directory, f"rank{dist.get_rank()}"), "w", encoding="utf-8") as f:
                f.write(f"{self.iteration}\t{phase}\t{time.time():.0f}\t{socket.gethostname()}\t{os.getpid()}")


class RoleSet:
    """``roles``: name -> Role, every role the algorithm runs; ``cut``: the rows this rank holds
    in the run's layout, ``cuts``: those of each role's own layout. ``overlap_budget``: device
    bytes free at start-up; with it, each next role's onload overlaps the current role's phase where
    the planner says both fit in it."""

    def __init__(self, config: RLHFConfig, ledger: MemoryLedger, pad_id: int, overlap_budget: Optional[int] = None,
                 progress: Optional[Progress] = None):
        from megatron.core import parallel_state as ps

        self.config = config
        self.ledger = ledger
        self.pad_id = pad_id
        self.progress = progress or Progress()
        self.cut = RowCut.of(ps.get_data_parallel_group())
        # A training step's metric sums are over DP x CP: a CP rank's are of its own positions.
        self.figures_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.roles: Dict[str, Role] = {}
        for name in config.model_roles:
            self.roles[name] = build_role(name, config)
            ledger.track(self.roles[name].memory)
        self.cuts = {name: RowCut.of(groups_of(role.model).dp) if config.has_own_layout(name) else self.cut
                     for name, role in self.roles.items()}
        self.overlaps = self._overlaps(overlap_budget) if overlap_budget is not None else {}
        self.syncs = [
            WeightSync(self.roles[trained], self.roles[serving], share=config.weight_owner(serving) is not None,
                       reshard=config.has_own_layout(serving))
            for serving, trained in config.served_weights.items()
        ]

    def __getitem__(self, name: str) -> Role:
        return self.roles[name]

    def __contains__(self, name: str) -> bool:
        return name in self.roles

    def _overlaps(self, budget: int) -> Dict[str, str]:
        """The successions whose onload may overlap (both phases fit in ``budget``), printed on rank 0."""
        from megatron_rlhf.memory.planner import overlap_fits, plan
        from megatron_rlhf.units import human

        planned = plan(self.config, dist.get_world_size())
        pairs = {a: b for a, b in self.config.successions.items() if overlap_fits(self.config, planned, a, b, budget)}
        if dist.get_rank() == 0:
            print(f"overlap_onload: {human(budget)} free on the device; overlapping "
                  f"{', '.join(f'{a} -> {b}' for a, b in pairs.items()) or 'nothing'}", flush=True)
        return pairs

    @contextlib.contextmanager
    def resident(self, name: str, phase: str):
        """``name`` on the device for ``phase``; where the role that runs next may overlap, its
        onload starts as soon as this role is on the device."""
        self.progress.mark(f"{name} ({phase})")
        with self.roles[name].resident(phase):
            following = self.overlaps.get(name)
            if following is not None:
                self.roles[following].memory.prefetch("training" if self.roles[following].trainable else "inference")
            yield

    def at_layout(self, name: str, run: Callable[[SampleRows], SampleRows], rows: SampleRows,
                  width: Optional[int] = None) -> SampleRows:
        """``run(rows)`` on role ``name``'s share of ``rows`` (this rank's share in the run's cut):
        the same rows when the role runs at the run's layout; otherwise its own DP share, and the
        result's columns come back in the run's cut, ``width`` positions wide (default: the longest
        row's). Collective over both DP groups."""
        cut = self.cuts[name]
        if cut == self.cut:
            return run(rows)
        out = recut(run(recut(rows, self.cut, cut, self.pad_id)), cut, self.cut, self.pad_id)
        return trimmed(out, width)

    def sync(self, whole: bool = False) -> int:
        """The trained weights to the roles that serve them; the bytes this rank received.
        ``whole``: a LoRA network's frozen base too (after a checkpoint was loaded)."""
        return sum(sync(whole) for sync in self.syncs)
