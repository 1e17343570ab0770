"""EMS: per-role offload/onload of weights, grad buffers and optimizer state; the memory ledger."""

from megatron_rlhf.memory.ledger import MemoryLeak, MemoryLeakWarning, MemoryLedger
from megatron_rlhf.memory.manager import (
    GRADS,
    KV_CACHE,
    LEDGER_KINDS,
    RESHARD_BUFFERS,
    MAIN_PARAMS,
    OFFLOAD_ORDER,
    OPTIMIZER_STATE,
    OTHER,
    TRANSIENT_KINDS,
    WEIGHTS,
    EMSSwitches,
    FixedAddressesNeeded,
    GradientsInUse,
    RoleMemory,
)

__all__ = [
    "EMSSwitches",
    "FixedAddressesNeeded",
    "GRADS",
    "GradientsInUse",
    "KV_CACHE",
    "RESHARD_BUFFERS",
    "LEDGER_KINDS",
    "MAIN_PARAMS",
    "MemoryLeak",
    "MemoryLeakWarning",
    "MemoryLedger",
    "OFFLOAD_ORDER",
    "OPTIMIZER_STATE",
    "OTHER",
    "RoleMemory",
    "TRANSIENT_KINDS",
    "WEIGHTS",
]
