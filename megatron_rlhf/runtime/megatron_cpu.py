"""Every adaptation that lets megatron-core's real code paths run on a machine without CUDA.

megatron-core assumes a GPU in a few places: it asks ``torch.cuda`` for the current device, streams,
events and RNG state; it creates small tensors with ``device='cuda'``; and its optimizer checks
parameter types by their CUDA type names. Each :class:`Adaptation` below answers one such assumption,
names the megatron-core file and line range it answers, and carries anchors: source text that must
still be found there. :func:`apply` first checks every anchor against the installed megatron-core and
raises if one moved or vanished, so an upgrade that changes these internals fails loudly at start-up
instead of silently computing something else. Applied by the CPU platform (platform.py): where no
GPU is present, or where one is but MEGATRON_RLHF_DEVICE=cpu asks for the CPU, in which case the
GPU is hidden from megatron-core first.

Nothing here changes what megatron computes: devices map to the CPU, synchronisation becomes a no-op
(CPU ops are synchronous), and RNG states are those of the CPU generator.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, List, Tuple

import torch
from torch.overrides import TorchFunctionMode

from megatron_rlhf.runtime.megatron_compat import Site, raise_if_changed, site_problems

# Measured facts behind these adaptations: docs/megatron_on_cpu.md.


@dataclasses.dataclass(frozen=True)
class Adaptation:
    name: str
    why: str
    sites: Tuple[Site, ...]
    apply: Callable[[], None]


# --------------------------------------------------------------------------------------------------
# The adaptations.


def _cuda_is_hidden() -> None:
    # torch.cuda.is_available() is torch's own answer (the driver's device count, cached); megatron
    # and torch consult it to pick devices, backends and kernels, so it must say "no GPU" here.
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 0  # type: ignore[assignment]


def _current_device_is_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


class _NoOpStream:
    """Stands for torch.cuda.Stream / Event: CPU ops complete in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpStream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _streams_and_events_are_noops() -> None:
    torch.cuda.Stream = _NoOpStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _NoOpStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _NoOpStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _NoOpStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


_CPU_TYPE_TO_CUDA_NAME = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Maps ``device='cuda'`` (and ``cuda:N``, integer devices, ``.cuda()``, ``pin_memory=True``) to
    the CPU, and reports CUDA type names from ``Tensor.type()`` as megatron's optimizer expects."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CPU_TYPE_TO_CUDA_NAME.get(name, name)
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


def _is_cuda_device(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_CUDA_TO_CPU_MODE = CudaToCpuMode()


@contextlib.contextmanager
def device_mapping_paused():
    """Torch ops without the device mode (it inspects every op, about 10% of a small forward): for
    code that never names a CUDA device. A no-op where the mode is not the innermost one."""
    from torch.overrides import _get_current_function_mode

    if _get_current_function_mode() is not _CUDA_TO_CPU_MODE:
        yield
        return
    _CUDA_TO_CPU_MODE.__exit__(None, None, None)
    try:
        yield
    finally:
        _CUDA_TO_CPU_MODE.__enter__()


def _cuda_device_literals_map_to_cpu() -> None:
    # Entered once and never left: the mode stays active for the life of the process.
    _CUDA_TO_CPU_MODE.__enter__()


def _rng_tracker_uses_cpu_generator() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's named RNG states (data-parallel, model-parallel, expert), kept as states of
        the CPU generator: ``add`` seeds a new named state, ``fork`` swaps it in and out."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _recompute_keeps_no_cuda_rng_state() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # Activation recompute saves and restores the CPU state, the CUDA state and the tracker's
    # states around each recomputed block. There is no CUDA generator here: an empty state and a
    # no-op restore (the CPU generator and the tracker, which holds CPU states, are still restored).
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    # Backward reaches the engine through Tensor.backward, which the device mode handles, and a
    # mode is off while its handler runs: the forward that recompute re-runs inside backward must
    # get the mode back to keep device='cuda' on the CPU.
    recompute_backward = mrandom.CheckpointFunction.backward

    def backward_with_cpu_devices(ctx, *grads):
        with _CUDA_TO_CPU_MODE:
            return recompute_backward(ctx, *grads)

    mrandom.CheckpointFunction.backward = staticmethod(backward_with_cpu_devices)


def _moe_split_sizes_on_host() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    to_host = moe_utils.maybe_move_tensor_to_cpu

    def to_host_as_numpy(tensor, as_numpy: bool = False, record_stream: bool = False):
        tensor = to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host_as_numpy


ADAPTATIONS: List[Adaptation] = [
    Adaptation(
        name="cuda_is_hidden",
        why="with MEGATRON_RLHF_DEVICE=cpu on a GPU machine, torch.cuda.is_available() must not send "
        "megatron's device and backend choices to the GPU",
        sites=(
            Site("utils.py", lines=(1448, 1452), anchor="if torch.cuda.is_available():"),
            Site("dist_checkpointing/strategies/torch.py", lines=(62, 66), anchor="if not torch.cuda.is_available():"),
        ),
        apply=_cuda_is_hidden,
    ),
    Adaptation(
        name="current_device_is_cpu",
        why="tensors are allocated on torch.cuda.current_device(); on CPU that call raises",
        sites=(
            Site("models/common/embeddings/rotary_pos_embedding.py", lines=(160, 163),
                 anchor="self.inv_freq.to(device=torch.cuda.current_device())"),
            Site("utils.py", lines=(625, 635), anchor="device=torch.cuda.current_device()"),
            Site("distributed/param_and_grad_buffer.py", lines=(778, 810),
                 anchor="device=torch.cuda.current_device()"),
            Site("pipeline_parallel/p2p_communication.py", lines=(188, 204),
                 anchor="device=torch.cuda.current_device()"),
        ),
        apply=_current_device_is_cpu,
    ),
    Adaptation(
        name="streams_and_events_are_noops",
        why="DDP's overlapped grad sync and p2p use CUDA streams, events and synchronize",
        sites=(
            Site("distributed/distributed_data_parallel.py", lines=(228, 232), anchor="torch.cuda.Stream("),
            Site("distributed/param_and_grad_buffer.py", lines=(415, 424), anchor="torch.cuda.stream("),
            Site("distributed/param_and_grad_buffer.py", lines=(527, 531), anchor="torch.cuda.default_stream()"),
            Site("pipeline_parallel/p2p_communication.py", lines=(240, 244), anchor="torch.cuda.synchronize()"),
        ),
        apply=_streams_and_events_are_noops,
    ),
    Adaptation(
        name="cuda_device_literals_map_to_cpu",
        why="optimizer, grad scaler, grad clipping and masks create tensors with device='cuda'; "
        "the optimizer accepts only parameters whose type() is a torch.cuda.* name",
        sites=(
            Site("optimizer/optimizer.py", lines=(471, 487), anchor="device='cuda'"),
            Site("optimizer/optimizer.py", lines=(688, 699), anchor="'torch.cuda.FloatTensor'"),
            Site("optimizer/distrib_optimizer.py", lines=(418, 435), anchor="'torch.cuda.FloatTensor'"),
            Site("optimizer/clip_grads.py", lines=(88, 117), anchor="device='cuda'"),
            Site("optimizer/grad_scaler.py", lines=(13, 16), anchor="device='cuda'"),
            Site("transformer/utils.py", lines=(33, 36), anchor='device="cuda"'),
            Site("distributed/param_and_grad_buffer.py", lines=(766, 770), anchor='device="cuda"'),
        ),
        apply=_cuda_device_literals_map_to_cpu,
    ),
    Adaptation(
        name="rng_tracker_uses_cpu_generator",
        why="CudaRNGStatesTracker.add/fork read and set torch.cuda RNG states",
        sites=(
            Site("tensor_parallel/random.py", lines=(233, 240), anchor="torch.cuda.get_rng_state()"),
            Site("tensor_parallel/random.py", lines=(282, 283), anchor="_CUDA_RNG_STATE_TRACKER_INITIALIZED = False"),
            Site("tensor_parallel/random.py", lines=(300, 303), anchor="if _CUDA_RNG_STATE_TRACKER_INITIALIZED:"),
        ),
        apply=_rng_tracker_uses_cpu_generator,
    ),
    Adaptation(
        name="recompute_keeps_no_cuda_rng_state",
        why="activation recompute (CheckpointFunction) saves and restores torch.cuda RNG states, "
        "and re-runs forward code inside backward, out of reach of the device mode",
        sites=(
            Site("tensor_parallel/random.py", lines=(444, 450), anchor="cuda_rng_state = _get_cuda_rng_state("),
            Site("tensor_parallel/random.py", lines=(454, 459), anchor="_set_cuda_rng_state("),
            Site("tensor_parallel/random.py", lines=(512, 516), anchor="ctx.rng_states = _get_all_rng_states()"),
            Site("tensor_parallel/random.py", lines=(530, 560), anchor="outputs = ctx.run_function(*detached_inputs)"),
        ),
        apply=_recompute_keeps_no_cuda_rng_state,
    ),
    Adaptation(
        name="moe_split_sizes_on_host",
        why="the all-to-all token dispatcher turns its split sizes into host numpy arrays only when they "
        "sit on a GPU; on the CPU they stay tensors, which gloo's all_to_all_single refuses",
        sites=(
            Site("transformer/moe/token_dispatcher.py", lines=(28, 36), anchor="maybe_move_tensor_to_cpu,"),
            Site("transformer/moe/token_dispatcher.py", lines=(876, 890),
                 anchor="self.input_splits = maybe_move_tensor_to_cpu("),
            Site("transformer/moe/moe_utils.py", lines=(1093, 1096), anchor="if torch.is_tensor(tensor) and tensor.is_cuda:"),
        ),
        apply=_moe_split_sizes_on_host,
    ),
]


def check_sites() -> List[str]:
    """Every site whose anchor is no longer in its line range, as readable problems."""
    return site_problems((a.name, a.sites) for a in ADAPTATIONS)


_applied = False


def apply() -> None:
    """Check every site, then apply every adaptation (once per process)."""
    global _applied
    if _applied:
        return
    raise_if_changed(check_sites(), "the CPU adaptations", "megatron_rlhf/runtime/megatron_cpu.py")
    for adaptation in ADAPTATIONS:
        adaptation.apply()
    _applied = True
