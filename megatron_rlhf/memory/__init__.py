"""EMS: per-role offload/onload of weights, grad buffers and optimizer state (manager.py); the kinds
of state and a role's switches (kinds.py, no torch); the memory ledger (ledger.py); the planner and
free_memory: auto. The names below are imported when first used: planning needs no torch."""

import importlib

_HOMES = {
    "megatron_rlhf.memory.kinds": ("GRADS", "KV_CACHE", "LEDGER_KINDS", "RESHARD_BUFFERS", "MAIN_PARAMS",
                                   "OFFLOAD_ORDER", "OPTIMIZER_STATE", "OTHER", "TRANSIENT_KINDS", "WEIGHTS",
                                   "EMSSwitches"),
    "megatron_rlhf.memory.manager": ("FixedAddressesNeeded", "GradientsInUse", "RoleMemory"),
    "megatron_rlhf.memory.ledger": ("MemoryLeak", "MemoryLeakWarning", "MemoryLedger"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name):
    if name not in _HOME_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME_OF[name]), name)
