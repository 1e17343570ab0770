"""The roles an algorithm runs (of policy, reference, reward, value, ppo_policy, ppo_value): each a
network at its layout, its optimizer when trained, its EMS memory; the role set that places them."""

from megatron_rlhf.roles.base import Role, assemble_role, build_role

__all__ = ["Role", "assemble_role", "build_role"]
