"""The generation engine's linear layers on CPU: oneDNN's GEMM on weights packed once per generation.

torch's CPU ``F.linear`` runs MKL's sgemm, which on the AMD machine this project is developed on
takes the generic path: about 105 GFLOP/s at decode sizes (16 rows) and 210 GFLOP/s at prefill
sizes with 2 threads, where oneDNN's GEMM on a weight reordered once into its blocked layout runs
2.4-4x faster (docs/megatron_on_cpu.md, "Linear layers"). The engine's weights do not change while
it generates, so the reorder is paid once per ``generate()`` for every decode step after it.

What changes: rounding. The products agree with ``F.linear`` to fp32 rounding (|diff| about 5e-5 on
outputs of magnitude 16, as close to float64 as MKL's), not bitwise; a row's result does not depend
on how many rows share the call (tests/test_cpu_linears.py). Only the engine's sampled tokens go
through these layers: log-probs, values and training keep torch's own kernel.

``MEGATRON_RLHF_CPU_LINEARS=torch`` turns it off (torch's F.linear, what transformers runs);
``onednn`` (the default where torch was built with oneDNN) turns it on. The packed copies live in
host memory while the engine runs (one copy of the stage's weights; the ledger does not see them).
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_rlhf.runtime import megatron_compat as compat

KERNEL_VARIABLE = "MEGATRON_RLHF_CPU_LINEARS"
KERNEL_CHOICES = ("onednn", "torch")
# oneDNN packs these on CPU where the CPU has the instructions (packs); another dtype (fp16) runs
# torch's F.linear.
_PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Smaller weights run torch's F.linear: oneDNN's ~8 us a call and ~80 us a reorder cost more than
# they save below about 48K elements at 16 rows (one thread; docs/megatron_on_cpu.md).
SMALLEST_PACKED_WEIGHT = 1 << 16


class LinearKernelChoiceError(ValueError):
    """MEGATRON_RLHF_CPU_LINEARS names no kernel this build of torch has."""


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def chosen_kernel() -> str:
    """``onednn`` or ``torch``: MEGATRON_RLHF_CPU_LINEARS where set, else oneDNN where torch has it."""
    value = os.environ.get(KERNEL_VARIABLE, "").strip().lower()
    if not value:
        return "onednn" if onednn_available() else "torch"
    if value not in KERNEL_CHOICES:
        raise LinearKernelChoiceError(f"{KERNEL_VARIABLE}={os.environ[KERNEL_VARIABLE]!r}: must be one of "
                                      f"{', '.join(KERNEL_CHOICES)} (or unset: onednn where torch was built with it)")
    if value == "onednn" and not onednn_available():
        raise LinearKernelChoiceError(f"{KERNEL_VARIABLE}=onednn, but torch {torch.__version__} was built without "
                                      "oneDNN (torch.backends.mkldnn.is_available() is False); use torch")
    return value


_packs: Dict[torch.dtype, bool] = {}


def packs(dtype: torch.dtype) -> bool:
    """Whether this machine's oneDNN packs weights of ``dtype``: probed once. Its bf16 GEMM needs
    AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, which the project's AMD VMs lack: there the reorder raises
    and bf16 runs torch's F.linear (oneDNN's own bf16 path already, unpacked)."""
    if dtype not in _packs:
        supported = dtype in _PACKED_DTYPES and onednn_available()
        if supported:
            try:
                pack(torch.zeros(1, 1, dtype=dtype))
            except RuntimeError:
                supported = False
        _packs[dtype] = supported
    return _packs[dtype]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [n, k] reordered into oneDNN's blocked layout (a copy, outside autograd)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_product(input: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """input [..., k] x the packed weight^T (+ bias [n]) -> [..., n]: oneDNN's GEMM."""
    return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")


class PackedWeights:
    """Each weight reordered for oneDNN on its first product, kept until the engine is done."""

    def __init__(self):
        # id -> (weight, packed): holding the weight keeps its id from being reused by another tensor
        self._packed: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` packed, once for the life of this object."""
        entry = self._packed.get(id(weight))
        if entry is None:
            entry = self._packed[id(weight)] = (weight, pack(weight))
        return entry[1]

    def matmul(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """input [..., k] x weight [n, k]^T (+ bias [n]) -> [..., n]."""
        if input.dtype != weight.dtype or weight.numel() < SMALLEST_PACKED_WEIGHT or not packs(weight.dtype):
            return F.linear(input, weight, bias)
        return packed_product(input, self.packed(weight), bias)


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module):
    """Within the block, ``model``'s parallel linears multiply by packed weights (see the module's
    docstring); the weights must not change inside. A no-op where the chosen kernel is torch's."""
    if chosen_kernel() == "torch":
        yield
        return
    with compat.linear_matmuls_replaced(model, PackedWeights().matmul):
        yield
