"""Checkpoints written while training goes on (``trainer.async_save``).

A save takes host copies of everything its rank writes before it returns (collective, each role
resident while copied: checkpoint/run_checkpoint.py's PendingSave.snapshot); a thread then writes the
files. The writer never reads a role's memory, so roles are offloaded, onloaded and trained
while it writes without changing what it writes, and it holds no device or page-locked memory:
only the copies, in ordinary host memory, until written. After every iteration the ranks check
together whether all have written (:meth:`CheckpointSaves.poll`); then the trainer state and the
manifest are added and ``latest`` moves to the new checkpoint. The next save, and the end of the
run, wait for the one in flight (:meth:`drain`). A process killed while writing leaves ``latest``
on the previous complete checkpoint; its partial directory is removed at the next start.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Mapping, Optional

import torch.distributed as dist

from megatron_rlhf.checkpoint.run_checkpoint import PendingSave, Writes, os_error_text, save_checkpoint, write_files
from megatron_rlhf.runtime.host_groups import every_rank, host_group


class CheckpointSaves:
    """A loop's checkpoint saves: written at once (``in_background`` false: :meth:`poll` and
    :meth:`drain` have nothing to do), or by a thread with at most one checkpoint in flight.
    Every method is collective (every rank calls it)."""

    def __init__(self, in_background: bool):
        self.in_background = in_background
        self.pending: Optional[PendingSave] = None
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[str] = None

    def save(self, roles: Mapping[str, Any], trainer_state: Dict[str, Any], output_dir: str,
             records: Optional[Dict[str, dict]] = None) -> str:
        """Save (or start writing) the checkpoint of ``trainer_state``'s iteration; its final directory."""
        if not self.in_background:
            return save_checkpoint(roles, trainer_state, output_dir, records)
        self.drain()
        pending = PendingSave(trainer_state, output_dir)
        with pending.failing_cleanly():
            writes = [w for role_writes in pending.snapshot(roles, records or {}) for w in role_writes]
        self.pending, self.error = pending, None
        self.thread = threading.Thread(target=self._write, args=(writes,), name="checkpoint-writer", daemon=True)
        self.thread.start()
        return pending.final

    def _write(self, writes: Writes) -> None:
        try:
            write_files(writes)
        except OSError as e:
            self.error = os_error_text(e)
        except Exception as e:  # noqa: BLE001 - reported by the main thread, collectively
            self.error = f"{type(e).__name__}: {e}"

    def poll(self) -> None:
        """Finish the save in flight if every rank has written its files (no waiting)."""
        if self.pending is not None and every_rank(not self.thread.is_alive()):
            self._finish()

    def drain(self) -> None:
        """Wait for the save in flight and finish it."""
        if self.pending is not None:
            self.thread.join()
            self._finish()

    def _finish(self) -> None:
        self.thread.join()
        errors: List[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, self.error, group=host_group())
        failure = next((f"rank {rank}: {error}" for rank, error in enumerate(errors) if error), None)
        pending, self.pending, self.thread = self.pending, None, None
        pending.finish(failure)

