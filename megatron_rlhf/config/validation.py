"""Checks across keys: parallel layouts the models cannot take, batch sizes that cannot divide, and
roles that must share an architecture. Run before any model is built."""

from __future__ import annotations

from typing import List, Optional

from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.config.schema import ROLE_NAMES, TRAINABLE_ROLES, RLHFConfig


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def layout_problems(config: RLHFConfig, world_size: Optional[int] = None) -> List[str]:
    """Every problem of the parallel layout and batch sizes, each naming file, key and what is valid."""
    problems: List[str] = []
    par = config.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    tp_key, pp_key = "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size"

    for key, value in ((tp_key, tp), (pp_key, pp)):
        if value < 1:
            problems.append(f"{config.source_of(key)}: {key}: must be >= 1, got {value}")
    if problems:
        return problems
    if par.sequence_parallel and tp == 1:
        problems.append(
            f"{config.source_of('parallel.sequence_parallel')}: parallel.sequence_parallel: needs "
            "tensor_model_parallel_size > 1; set it to false or raise TP"
        )
    dp = None
    if world_size is not None:
        if world_size % (tp * pp) != 0:
            problems.append(
                f"{config.source_of(tp_key)}: parallel: world size {world_size} is not divisible by "
                f"TP*PP = {tp}*{pp} = {tp * pp}; valid TP*PP for this world size: "
                f"{_divisors(world_size)}"
            )
        else:
            dp = world_size // (tp * pp)

    for role in ROLE_NAMES:
        rc = config.role(role)
        m = rc.model
        at = f"{role}.model"
        file = config.source_of(at)
        heads, groups = m.num_attention_heads, m.kv_groups
        if heads % groups != 0:
            problems.append(
                f"{file}: {at}.num_query_groups: {groups} does not divide num_attention_heads={heads}; "
                f"valid: {_divisors(heads)}"
            )
        if m.hidden_size % heads != 0:
            problems.append(
                f"{file}: {at}.hidden_size: {m.hidden_size} is not divisible by "
                f"num_attention_heads={heads}"
            )
        if heads % tp != 0:
            problems.append(
                f"{config.source_of(tp_key)}: {tp_key}: {tp} does not divide {role}'s "
                f"num_attention_heads={heads} ({file}); valid TP: {_divisors(heads)}"
            )
        elif groups % tp != 0:
            problems.append(
                f"{config.source_of(tp_key)}: {tp_key}: {tp} does not divide {role}'s "
                f"num_query_groups={groups} (grouped-query attention, {file}); valid TP: "
                f"{_divisors(groups)}"
            )
        if m.ffn_hidden_size % tp != 0:
            problems.append(
                f"{config.source_of(tp_key)}: {tp_key}: {tp} does not divide {role}'s "
                f"ffn_hidden_size={m.ffn_hidden_size} ({file})"
            )
        if m.num_layers % pp != 0:
            problems.append(
                f"{config.source_of(pp_key)}: {pp_key}: {pp} does not divide {role}'s "
                f"num_layers={m.num_layers} ({file}); valid PP: {_divisors(m.num_layers)}"
            )
        if rc.micro_batch_size < 1:
            problems.append(
                f"{config.source_of(role + '.micro_batch_size')}: {role}.micro_batch_size: must be "
                f">= 1, got {rc.micro_batch_size}"
            )
        if role in TRAINABLE_ROLES and rc.global_batch_size is not None and dp is not None:
            step = rc.micro_batch_size * dp
            if rc.global_batch_size % step != 0:
                problems.append(
                    f"{config.source_of(role + '.global_batch_size')}: {role}.global_batch_size: "
                    f"{rc.global_batch_size} is not divisible by micro_batch_size*DP = "
                    f"{rc.micro_batch_size}*{dp} = {step}; use a multiple of {step}"
                )

    # Weight sync copies or shares trained weights into the inference role: same network.
    for trained, serving in (("ppo_policy", "policy"), ("ppo_value", "value")):
        if config.role(trained).model != config.role(serving).model:
            problems.append(
                f"{config.source_of(trained + '.model')}: {trained}.model: differs from "
                f"{serving}.model ({config.source_of(serving + '.model')}); weight sync needs the "
                "same architecture"
            )
    return problems


def validate(config: RLHFConfig, world_size: Optional[int] = None) -> None:
    """Raise ConfigError listing every layout problem (all of them, not just the first)."""
    problems = layout_problems(config, world_size)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
