"""The kinds of state EMS moves, what each phase needs of them, and a role's switches: plain names
and values, no torch (the planner, the dry run and the configuration read them on any machine)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rlhf.config.schema import EMS_SWITCHES

GRADS, MAIN_PARAMS, OPTIMIZER_STATE, WEIGHTS, OTHER = (
    "grads", "main_params", "optimizer_state", "weights", "other",
)
OFFLOAD_ORDER = (GRADS, MAIN_PARAMS, OPTIMIZER_STATE, WEIGHTS)
ONLOAD_ORDER = tuple(reversed(OFFLOAD_ORDER))
LEDGER_KINDS = (WEIGHTS, GRADS, MAIN_PARAMS, OPTIMIZER_STATE, OTHER)
# Memory a role holds only while a phase runs (allocated for it, released after): the ledger
# records it beside the state kinds and apart from them.
KV_CACHE = "kv_cache"
RESHARD_BUFFERS = "reshard_buffers"  # megatron's resharding: received slices and copies of sent ones
TRANSIENT_KINDS = (KV_CACHE, RESHARD_BUFFERS)
# What each phase needs on the device.
PHASE_NEEDS = {
    "inference": (WEIGHTS,),
    "training": (WEIGHTS, GRADS, MAIN_PARAMS, OPTIMIZER_STATE),
}


@dataclasses.dataclass(frozen=True)
class EMSSwitches:
    """Which kinds leave the device when the role is idle (see RoleConfig)."""

    offload_weights: bool = False
    free_grad_buffers: bool = False
    offload_optimizer_state: bool = False  # main params and Adam states together
    empty_cache: bool = True

    @classmethod
    def from_role_config(cls, rc, auto: Optional[bool] = None) -> "EMSSwitches":
        """The role's switches; ``auto``: what a switch not yet chosen by free_memory: auto counts
        as (planning only; None: such a switch is an error)."""
        return cls(**{name: rc.ems_switch(name, auto) for name in EMS_SWITCHES}, empty_cache=rc.empty_cache)

    def kinds(self) -> tuple:
        on = {
            GRADS: self.free_grad_buffers,
            MAIN_PARAMS: self.offload_optimizer_state,
            OPTIMIZER_STATE: self.offload_optimizer_state,
            WEIGHTS: self.offload_weights,
        }
        return tuple(k for k in OFFLOAD_ORDER if on[k])
