"""Process start-up, megatron parallel state and the device platform."""

from megatron_rlhf.runtime.distributed import (
    destroy_distributed,
    init_distributed,
    set_seed,
)
from megatron_rlhf.runtime.platform import DevicePlatform, get_platform

__all__ = [
    "DevicePlatform",
    "destroy_distributed",
    "get_platform",
    "init_distributed",
    "set_seed",
]
