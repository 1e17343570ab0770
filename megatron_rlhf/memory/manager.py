"""EMS: the per-role manager that moves each kind of resident state off the device and back.

Kinds, in offload order (onload is the reverse), chosen so the transient peak stays lowest:
- ``grads``: megatron DDP's contiguous grad buffers, freed (storage resized to 0) and rebuilt
  zeroed; every ``param.main_grad`` and bucket view stays valid (megatron's own
  ``offload_grad_buffers`` / ``restore_grad_buffers``).
- ``main_params``: the optimizer's fp32 master copies of bf16 weights (distributed-optimizer shards
  or the plain optimizer's full copies), to host memory and back.
- ``optimizer_state``: Adam's exp_avg / exp_avg_sq (and step), to host memory and back.
- ``weights``: the parameters (DDP's contiguous param buffer where the distributed optimizer made
  one, else each parameter), to host memory and back.

Moves work on whole storages: the device storage is resized to 0 and later re-grown in place,
so every tensor and view that refers to it (param.data, main_grad, optimizer shards, bucket
views) stays valid and nothing needs re-pointing. Each kind has one host arena of exactly its bytes
(page-locked on CUDA), allocated at its first offload and reused on every later round trip. A kind
whose device copy cannot have changed since the arena was written (an inference phase only reads
weights) is freed on offload without a copy: a frozen role copies its weights once. Every step is
idempotent.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_rlhf.memory.kinds import (GRADS, LEDGER_KINDS, MAIN_PARAMS, OFFLOAD_ORDER, ONLOAD_ORDER,
                                        OPTIMIZER_STATE, OTHER, PHASE_NEEDS, TRANSIENT_KINDS, WEIGHTS, EMSSwitches)
from megatron_rlhf.runtime import megatron_compat as compat
from megatron_rlhf.runtime.platform import DevicePlatform, get_platform

class FixedAddressesNeeded(ValueError):
    """The model was built with settings that need its storages never to move (EMS moves them)."""


class GradientsInUse(RuntimeError):
    """Freeing the grad buffers now would discard gradients still being accumulated."""


def _unique_storages(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """One representative tensor per distinct, allocated storage, in first-seen order."""
    seen, out = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append(t)
    return out


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` as they are now (0 for a freed one)."""
    return sum(t.untyped_storage().nbytes() for t in _unique_storages(tensors))


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _StorageMover:
    """Moves the storages of one kind to one host arena and back.

    The arena holds every storage of the kind back to back, exactly their bytes, and is reused on
    every round trip while the storages keep their sizes. ``host_current`` says whether the arena
    still holds what the device holds: the owner clears it (``mark_dirty``) whenever the device
    copy may change, and an offload of a clean kind frees the device storages without copying.
    Storages are keyed by a persistent tensor that refers to them (a Parameter, DDP's param_data,
    an optimizer-state tensor), which the mover holds so that its id stays unique.
    """

    def __init__(self, platform: DevicePlatform):
        self.platform = platform
        self._arena: Optional[torch.Tensor] = None
        self._layout: List[Tuple[torch.Tensor, int, int]] = []  # (tensor, offset, bytes) in the arena
        self._offloaded = False
        self.host_current = False
        self.copied_bytes = 0  # device -> host, over the life of the mover

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def mark_dirty(self) -> None:
        self.host_current = False

    def offload(self, tensors: Sequence[torch.Tensor]) -> None:
        if self._offloaded:
            return  # already off the device
        layout, offset = [], 0
        for t in _unique_storages(tensors):
            nbytes = t.untyped_storage().nbytes()
            layout.append((t, offset, nbytes))
            offset += nbytes
        if [(id(t), n) for t, _, n in layout] != [(id(t), n) for t, _, n in self._layout]:
            self.release()  # other storages or sizes: a new arena, and nothing in it yet
            self._arena, self._layout = self.platform.host_arena(offset), layout
        if not self.host_current:
            for t, start, nbytes in self._layout:
                self._arena[start:start + nbytes].copy_(_bytes_view(t.untyped_storage()), non_blocking=True)
            self.copied_bytes += offset
            # The copies must land before the device memory can be handed to anyone else.
            self.platform.synchronize()
            self.host_current = True
        for t, _, _ in self._layout:
            t.untyped_storage().resize_(0)
        self._offloaded = bool(self._layout)

    def onload(self) -> None:
        if not self._offloaded:
            return
        for t, start, nbytes in self._layout:
            storage = t.untyped_storage()
            storage.resize_(nbytes)
            _bytes_view(storage).copy_(self._arena[start:start + nbytes], non_blocking=True)
        self._offloaded = False

    def release(self) -> None:
        """Give the host arena back (only while the storages are on the device)."""
        if self._offloaded:
            raise RuntimeError("the host arena holds the only copy of an offloaded kind")
        if self._arena is not None:
            self.platform.release_host_arena(self._arena)
        self._arena, self._layout, self.host_current = None, [], False

    def host_bytes(self) -> int:
        return 0 if self._arena is None else self._arena.numel()


class RoleMemory:
    """EMS for one role: its model (megatron DDP for trainable roles) and optimizer (or None)."""

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        optimizer=None,
        switches: EMSSwitches = EMSSwitches(),
        platform: Optional[DevicePlatform] = None,
        on_event: Optional[Callable[[str, str, str], None]] = None,
    ):
        pinned = compat.fixed_address_settings(model)
        if pinned and switches.kinds():
            raise FixedAddressesNeeded(
                f"{name}: built with {', '.join(pinned)}, which needs its device storages never to move, but its EMS "
                f"switches move {', '.join(switches.kinds())}; build it without those settings or turn EMS off for it")
        self.name = name
        self.model = model
        self.optimizer = optimizer
        self.switches = switches
        self.platform = platform or get_platform()
        self.on_event = on_event  # (event, phase, role) after each onload/offload, for the ledger
        self._movers = {kind: _StorageMover(self.platform) for kind in (MAIN_PARAMS, OPTIMIZER_STATE, WEIGHTS)}
        self._grads_freed = False
        self._backward_since_step = False
        self._transient: Dict[str, List[torch.Tensor]] = {}
        self.weights_owner: Optional["RoleMemory"] = None  # set by share_weights_with
        if optimizer is not None:
            for p in model.parameters():
                if p.requires_grad:
                    p.register_hook(self._note_backward)

    # -- what each kind is made of ------------------------------------------------------------

    def share_weights_with(self, owner: "RoleMemory") -> None:
        """This role's parameters now alias ``owner``'s storage: its weights move with the owner's
        (onload and offload act on the owner's) and are counted once, on the owner."""
        self.onload([WEIGHTS])
        self._movers[WEIGHTS].release()  # its own host copy is obsolete: no dead arena
        self.weights_owner = owner

    def tensors(self, kind: str) -> List[torch.Tensor]:
        """The tensors whose storages make up ``kind`` for this role (possibly freed)."""
        if kind == WEIGHTS and self.weights_owner is not None:
            return []
        if kind == WEIGHTS:
            with_storage = [b for b in compat.ddp_buffers(self.model) if compat.buffer_param_storage(b) is not None]
            in_buffers = {id(p) for b in with_storage for p in compat.buffer_params(b)}
            return [compat.buffer_param_storage(b) for b in with_storage] + [
                p for p in self.model.parameters() if id(p) not in in_buffers
            ]
        if kind == GRADS:
            grads = (compat.buffer_grad_storage(b) for b in compat.ddp_buffers(self.model))
            return [g for g in grads if g is not None]
        if self.optimizer is None:
            return []
        out: List[torch.Tensor] = []
        for opt in compat.inner_optimizers(self.optimizer):
            if kind == MAIN_PARAMS:
                out.extend(compat.main_param_tensors(opt))
            elif kind == OPTIMIZER_STATE:
                for state in compat.adam_state(opt).values():
                    out.extend(v for v in state.values() if torch.is_tensor(v))
        return out

    def other_tensors(self) -> List[torch.Tensor]:
        """Module buffers (e.g. rotary frequencies): small, never moved."""
        # nn.Module.buffers: megatron DDP shadows the method with its list of grad buffers.
        return list(torch.nn.Module.buffers(self.model))

    def resident_bytes(self) -> Dict[str, int]:
        """Device bytes per kind (state, then transient), counted from the storages as they are now."""
        state = {
            kind: storage_bytes(self.other_tensors() if kind == OTHER else self.tensors(kind))
            for kind in LEDGER_KINDS
        }
        return {**state, **{kind: storage_bytes(self._transient.get(kind, [])) for kind in TRANSIENT_KINDS}}

    def leftovers(self) -> Dict[str, int]:
        """Device bytes still held by kinds that are off the device, counted from every tensor that
        belongs to the kind as the model and optimizer see it (each parameter, each main_grad, each
        optimizer tensor), not from the storages EMS moved: a tensor re-pointed behind EMS's back
        shows here."""
        params = list(self.model.parameters())
        seen = {
            WEIGHTS: params,
            GRADS: [p.main_grad for p in params if getattr(p, "main_grad", None) is not None],
        }
        out = {}
        for kind in OFFLOAD_ORDER:
            if not self.is_resident(kind):
                held = storage_bytes(seen.get(kind) or self.tensors(kind))
                if held:
                    out[kind] = held
        return out

    def host_bytes(self) -> int:
        """Bytes of this role's host arenas."""
        return sum(m.host_bytes() for m in self._movers.values())

    def copied_bytes(self) -> int:
        """Bytes copied device -> host by this role's offloads so far."""
        return sum(m.copied_bytes for m in self._movers.values())

    # -- moves --------------------------------------------------------------------------------

    def _note_backward(self, grad):
        self._backward_since_step = True
        return grad

    def optimizer_stepped(self) -> None:
        """Called after each optimizer step: the accumulated gradients have been consumed."""
        self._backward_since_step = False

    def is_resident(self, kind: str) -> bool:
        if kind == GRADS:
            return not self._grads_freed
        if kind == WEIGHTS and self.weights_owner is not None:
            return self.weights_owner.is_resident(WEIGHTS)
        return not self._movers[kind].offloaded

    def offload(self, kinds: Optional[Sequence[str]] = None) -> None:
        """Move ``kinds`` (default: the role's switched-on kinds) off the device, grads first."""
        kinds = self.switches.kinds() if kinds is None else tuple(kinds)
        # Device work still queued (a prefetch on the side stream, the phase's own kernels) must be
        # done before storages are freed: the allocator may hand a freed block to the other stream.
        self.platform.join_side_stream()
        self.platform.synchronize()
        freed = 0
        for kind in OFFLOAD_ORDER:
            if kind not in kinds or not self.is_resident(kind):
                continue
            freed += storage_bytes(self.tensors(kind))  # a shared role's weights: the owner's offload says
            if kind == GRADS:
                self._free_grads()
            elif kind == WEIGHTS and self.weights_owner is not None:
                self.weights_owner.offload([WEIGHTS])
            else:
                self._movers[kind].offload(self.tensors(kind))
        if freed and self.switches.empty_cache:  # nothing freed, nothing to give back
            self.platform.empty_cache(freed)

    def onload(self, kinds: Sequence[str] = OFFLOAD_ORDER, read_only: bool = False) -> None:
        """Bring ``kinds`` back (weights first, grads last). Unless ``read_only`` (the caller only
        reads them), their host copies count as stale from now on."""
        self.platform.join_side_stream()
        self._queue_onload(kinds, read_only)
        self.platform.synchronize()

    def prefetch(self, phase: str) -> None:
        """Start bringing back what ``phase`` needs on the platform's side stream, to overlap with
        the work running now; ``resident(phase)`` (and any move) waits for it first, so the role
        never sees it half-done. On CPU it completes here, in program order."""
        with self.platform.side_stream():
            self._queue_onload(PHASE_NEEDS[phase], read_only=phase == "inference")
        self._emit("prefetch", phase)

    def _queue_onload(self, kinds: Sequence[str], read_only: bool) -> None:
        for kind in ONLOAD_ORDER:
            if kind not in kinds:
                continue
            if kind == WEIGHTS and self.weights_owner is not None:
                self.weights_owner._queue_onload([WEIGHTS], read_only)
            elif kind == GRADS:
                if self._grads_freed:
                    compat.restore_grad_buffers(self.model)
                    self._grads_freed = False
            else:
                self._movers[kind].onload()
                if not read_only:
                    self._movers[kind].mark_dirty()

    def _free_grads(self) -> None:
        if not compat.ddp_buffers(self.model):
            return
        if self._backward_since_step:
            raise GradientsInUse(
                f"{self.name}: backward ran since the last optimizer step, so its grad buffers hold "
                "gradients still being accumulated; freeing them now would discard them. Finish the "
                "step first, or offload without 'grads'."
            )
        compat.free_grad_buffers(self.model)
        self._grads_freed = True

    @contextlib.contextmanager
    def resident(self, phase: str = "inference") -> Iterator[None]:
        """On the device for ``phase`` ('inference': weights; 'training': every kind), and off
        again (the switched-on kinds) when the block ends."""
        if phase not in PHASE_NEEDS:
            raise ValueError(f"phase must be one of {', '.join(PHASE_NEEDS)}, got {phase!r}")
        self.onload(PHASE_NEEDS[phase], read_only=phase == "inference")
        self._emit("onload", phase)
        try:
            yield
        except BaseException:
            # The phase failed (a collective timed out mid-step): its half-accumulated gradients are
            # abandoned with it, and the failure itself is what the run reports.
            self._backward_since_step = False
            raise
        finally:
            self.offload()
            self._emit("offload", phase)

    @contextlib.contextmanager
    def holding(self, kind: str, tensors: Sequence[torch.Tensor], phase: str) -> Iterator[None]:
        """``tensors`` are this role's transient ``kind`` while the block runs: the ledger records
        them when the block starts ('allocate') and gone when it ends ('release'); the caller
        frees them before the block ends."""
        if kind not in TRANSIENT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(TRANSIENT_KINDS)}, got {kind!r}")
        self._transient[kind] = list(tensors)
        self._emit("allocate", phase)
        try:
            yield
        finally:
            del self._transient[kind]
            self._emit("release", phase)

    def _emit(self, event: str, phase: str) -> None:
        if self.on_event is not None:
            self.on_event(event, phase, self.name)
