"""Configuration: YAML with ${ENV:default} and includes, typed objects, validation."""

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.loader import load_config, load_tree
from megatron_rlhf.config.presets import PRESETS
from megatron_rlhf.config.schema import (
    ROLE_HEADS,
    PPO_ROLES,
    ROLE_NAMES,
    TRAINABLE_ROLES,
    ModelArchConfig,
    ParallelConfig,
    RLHFConfig,
    RoleConfig,
)
from megatron_rlhf.config.validation import input_problems, layout_problems, validate

__all__ = [
    "ConfigError",
    "PRESETS",
    "ModelArchConfig",
    "ParallelConfig",
    "RLHFConfig",
    "ROLE_HEADS",
    "PPO_ROLES",
    "ROLE_NAMES",
    "RoleConfig",
    "TRAINABLE_ROLES",
    "input_problems",
    "layout_problems",
    "load_config",
    "load_tree",
    "validate",
]
