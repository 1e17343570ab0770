"""The six RLHF roles (policy, reference, reward, value, ppo_policy, ppo_value)."""

from megatron_rlhf.roles.base import Role, assemble_role, build_role

__all__ = ["Role", "assemble_role", "build_role"]
