"""The device platform: everything that differs between a CUDA machine and a CPU-only one.

``MEGATRON_RLHF_DEVICE=cpu|cuda`` overrides the choice (the test suite runs its multi-process tests
on CPU/gloo on a one-GPU machine this way).

The rest of the package asks the platform for its device, its collective backend, host buffers for
offloading, and memory figures; it never branches on ``torch.cuda.is_available()`` itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import mmap
import os
import weakref
from typing import Callable, Dict, Optional

import torch


# megatron TransformerConfig's kernel fusion switches.
FUSIONS = ("bias_activation_fusion", "masked_softmax_fusion", "apply_rope_fusion", "persist_layer_norm",
           "gradient_accumulation_fusion")
# The compiled extensions megatron's fused softmax imports (built with apex or megatron from source).
SOFTMAX_KERNELS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")


class DevicePlatform:
    """Interface of a device platform. One instance per process (see :func:`get_platform`)."""

    name: str = "abstract"
    dist_backend: str = "gloo"
    # megatron builds weights on the CPU and slices them (no device to initialise on).
    use_cpu_initialization: bool = True
    # Steps the generation engine learns of EOS late, so that the host never waits for the step it
    # has just queued (0 where host and device are one).
    completion_lag: int = 0
    # Whether megatron's fused kernels run (torch.compile'd): not without a GPU (megatron_compat.import_megatron).
    compiles_kernels: bool = False
    # Whether the generation engine replays its decode steps as CUDA graphs (generation/decode.py).
    captures_graphs: bool = False

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def setup(self, local_rank: int) -> None:
        """Bind this process to its device and make megatron-core usable on it."""

    def host_arena(self, nbytes: int) -> torch.Tensor:
        """An uninitialised host byte buffer of exactly ``nbytes`` (page-locked where that helps
        copies), for EMS; give it back with :meth:`release_host_arena`."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def release_host_arena(self, arena: torch.Tensor) -> None:
        """Undo what :meth:`host_arena` did beyond allocating (the memory goes with the tensor)."""

    @property
    def has_transformer_engine(self) -> bool:
        """Whether transformer-engine's layers can be used (installed, on a GPU)."""
        return False

    def place_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` on this platform's device."""
        return module

    def kernel_fusions(self) -> Dict[str, bool]:
        """megatron TransformerConfig fusion switches that this platform can run (the unfused paths
        compute the same function)."""
        return dict.fromkeys(FUSIONS, False)

    def synchronize(self) -> None:
        """Wait for all queued device work."""

    def side_stream(self):
        """A context in which device work is queued apart from the main stream, to overlap with
        it; it starts after everything queued on the main stream so far. On CPU, work runs in
        program order (the context does nothing)."""
        return contextlib.nullcontext()

    def join_side_stream(self) -> None:
        """Make the main stream wait for everything queued on the side stream so far."""

    def plain_tensor_ops(self):
        """A context in which torch ops run without this platform's per-op adaptations (for code
        known not to need them: the generation engine's steps)."""
        return contextlib.nullcontext()

    def engine_linears(self, model: torch.nn.Module):
        """A context in which ``model``'s linear layers may run a kernel suited to weights that do
        not change inside it (the generation engine's; results agree to rounding, not bitwise)."""
        return contextlib.nullcontext()

    def copy_to_host_async(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start copying ``tensor`` to the host (queued after the work that writes it); returns a
        function that waits for the copy and gives it."""
        copy = tensor.to("cpu", copy=True)
        return lambda: copy

    def staged_copy(self, shape, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """A copier of host tensors (at most ``shape``'s elements) into device tensors of their
        shape, the host not waiting for the copy (CUDA); here a plain copy."""
        return lambda host, out: out.copy_(host)

    def empty_cache(self, freed_bytes: Optional[int] = None) -> None:
        """Hand cached, unused device memory back (a no-op where there is no caching allocator);
        ``freed_bytes``: what the phase boundary that asks just freed (None: an explicit call)."""

    def memory_stats(self) -> Dict[str, int]:
        """Allocator figures on CUDA, process RSS on CPU, in bytes."""
        raise NotImplementedError

    def device_free_bytes(self) -> int:
        """Device memory free now (on CPU, the RAM available)."""
        import psutil

        return psutil.virtual_memory().available

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak-measurement window."""


class CudaPlatform(DevicePlatform):
    name = "cuda"
    captures_graphs = True
    completion_lag = 2
    compiles_kernels = True
    dist_backend = "nccl"
    use_cpu_initialization = False

    def __init__(self) -> None:
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._side = None  # the stream onloads overlap on
        self._registered: Dict[int, weakref.finalize] = {}  # host arenas page-locked, by address

    @property
    def device(self) -> torch.device:
        return self._device

    def setup(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)
        self._device = torch.device("cuda", local_rank)

    def host_arena(self, nbytes: int) -> torch.Tensor:
        # torch's pinned allocator rounds every block up to a power of two and caches freed blocks
        # (1.39x to 1.99x the offloaded bytes for Llama-2 shards); pages of our own, page-locked in
        # place, are exactly nbytes rounded to a page and go back to the OS when released. They are
        # an anonymous mapping, not malloc's: a heap block can share a page with another arena,
        # and the driver registers whole pages (a second registration, or an unregistration that
        # unpins a neighbour's page, fails later at an unrelated kernel).
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        pages = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        arena = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes)
        _check_cudart("cudaHostRegister", torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), nbytes, 0),
                      f"of {nbytes} host bytes", "the node may be out of page-lockable memory (ulimit -l)")
        # Unregistered exactly once: by release_host_arena, or when the tensor goes (a role dropped
        # without releasing) before its pages are unmapped; a stale registration of an address
        # range the OS hands out again breaks the next copy from it.
        unregister = weakref.finalize(arena, _unregister_host, arena.data_ptr())
        unregister.atexit = False  # the process's end unmaps and unpins everything
        self._registered[arena.data_ptr()] = unregister
        return arena

    def release_host_arena(self, arena: torch.Tensor) -> None:
        unregister = self._registered.pop(arena.data_ptr(), None)
        if unregister is not None:
            self.synchronize()  # no queued copy may still read the pages
            unregister()

    @property
    def has_transformer_engine(self) -> bool:
        return importlib.util.find_spec("transformer_engine") is not None

    def place_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.cuda(self._device)

    def kernel_fusions(self) -> Dict[str, bool]:
        # megatron-core's own: SwiGLU through torch.compile; the fused masked softmax only where
        # its kernels are built (megatron imports them unguarded once a shape qualifies: a wheel
        # of megatron-core without them fails at the first long enough sequence). RoPE fusion and
        # fused weight-gradient accumulation are transformer-engine kernels (apex for the latter
        # with local layers); persist_layer_norm is apex's LayerNorm, not RMSNorm.
        te = self.has_transformer_engine
        return dict(super().kernel_fusions(), bias_activation_fusion=True,
                    masked_softmax_fusion=all(importlib.util.find_spec(k) is not None for k in SOFTMAX_KERNELS),
                    apply_rope_fusion=te, gradient_accumulation_fusion=te)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    @contextlib.contextmanager
    def side_stream(self):
        if self._side is None:
            self._side = torch.cuda.Stream(self._device)
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            yield

    def join_side_stream(self) -> None:
        if self._side is not None:
            torch.cuda.current_stream().wait_stream(self._side)

    def empty_cache(self, freed_bytes: Optional[int] = None) -> None:
        torch.cuda.empty_cache()

    def staged_copy(self, shape, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None]:
        # Two pinned buffers in turn: a buffer is written again only once its last copy is done,
        # which the host rarely waits for (the copy before the previous one).
        ring = [torch.empty(shape, dtype=dtype, pin_memory=True).view(-1) for _ in range(2)]
        done: list = [None, None]
        turn = [0]

        def copy(host: torch.Tensor, out: torch.Tensor) -> None:
            i = turn[0]
            turn[0] ^= 1
            if done[i] is not None:
                done[i].synchronize()
            staged = ring[i][: host.numel()].view(host.shape).copy_(host)
            out.copy_(staged, non_blocking=True)
            done[i] = torch.cuda.Event()
            done[i].record()

        return copy

    def copy_to_host_async(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> torch.Tensor:
            done.synchronize()
            return host

        return wait

    def memory_stats(self) -> Dict[str, int]:
        stats = torch.cuda.memory_stats()
        return {
            "allocated": stats.get("allocated_bytes.all.current", 0),
            "reserved": stats.get("reserved_bytes.all.current", 0),
            "peak_allocated": stats.get("allocated_bytes.all.peak", 0),
            "peak_reserved": stats.get("reserved_bytes.all.peak", 0),
            "inactive_split": stats.get("inactive_split_bytes.all.current", 0),
        }

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def device_free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self._device)[0]


def _check_cudart(call: str, code, what: str, hint: str = "") -> None:
    if int(code) != 0:
        raise RuntimeError(f"{call} {what} failed: CUDA error {int(code)}{hint and '; ' + hint}")


def _unregister_host(address: int) -> None:
    _check_cudart("cudaHostUnregister", torch.cuda.cudart().cudaHostUnregister(address), f"of the arena at {address:#x}")


def _load_libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


class CpuPlatform(DevicePlatform):
    name = "cpu"
    dist_backend = "gloo"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def setup(self, local_rank: int) -> None:
        from megatron_rlhf.runtime import megatron_cpu

        megatron_cpu.apply()

    def plain_tensor_ops(self):
        from megatron_rlhf.runtime import megatron_cpu

        return megatron_cpu.device_mapping_paused()

    def engine_linears(self, model: torch.nn.Module):
        from megatron_rlhf.runtime import cpu_linears

        return cpu_linears.packed_linears(model)

    def empty_cache(self, freed_bytes: Optional[int] = None) -> None:
        # The CPU counterpart of the CUDA allocator cache: free heap pages glibc still holds. At a
        # phase boundary only past TRIM_AT_BYTES freed: a trim walks the heap and every page it
        # gives back faults in again at the next allocation (33 ms a step of the pipeline demo's
        # reward model for a few MiB), and storages of that size and more are unmapped when freed.
        if _LIBC is not None and (freed_bytes is None or freed_bytes >= TRIM_AT_BYTES):
            _LIBC.malloc_trim(0)

    def memory_stats(self) -> Dict[str, int]:
        import psutil

        info = psutil.Process(os.getpid()).memory_info()
        return {"rss": info.rss}


TRIM_AT_BYTES = 32 << 20  # glibc's largest mmap threshold: larger storages go back to the system when freed
DEVICE_VARIABLE = "MEGATRON_RLHF_DEVICE"
DEVICE_CHOICES = ("cpu", "cuda")


class DeviceChoiceError(RuntimeError):
    """MEGATRON_RLHF_DEVICE names no platform this machine has."""


def chosen_device() -> str:
    """``cpu`` or ``cuda``: MEGATRON_RLHF_DEVICE where set, else CUDA where a GPU is visible."""
    value = os.environ.get(DEVICE_VARIABLE, "").strip().lower()
    if not value:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value not in DEVICE_CHOICES:
        raise DeviceChoiceError(
            f"{DEVICE_VARIABLE}={os.environ[DEVICE_VARIABLE]!r}: must be one of {', '.join(DEVICE_CHOICES)} "
            "(or unset: cuda where a GPU is visible, else cpu)"
        )
    if value == "cuda" and not torch.cuda.is_available():
        raise DeviceChoiceError(f"{DEVICE_VARIABLE}=cuda, but torch sees no CUDA device on this machine "
                                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    return value


@functools.lru_cache(maxsize=1)
def get_platform() -> DevicePlatform:
    """The platform of this process (see :func:`chosen_device`). A CPU platform on a machine with a
    GPU (MEGATRON_RLHF_DEVICE=cpu) hides the GPU from megatron-core (megatron_cpu.apply)."""
    return CudaPlatform() if chosen_device() == "cuda" else CpuPlatform()
