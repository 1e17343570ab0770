"""Checks across keys: parallel layouts the models cannot take, batch sizes that cannot divide, and
roles that must share an architecture. Run before any model is built."""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional, Tuple

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.families import FAMILIES
from megatron_rlhf.config.presets import CHECKPOINT_META_FILE
from megatron_rlhf.config.names import (CHAT_ROLES, GROUP_ESTIMATORS, JUDGE_FIELDS, LORA_TARGETS, LOSS_AGG_MODE_OF,
                                        PLAIN_TEXT_PARSERS, SANDBOX_KIND_KEYS, TOKEN_REWARD_ESTIMATORS)
from megatron_rlhf.config.schema import (CRITIC_ROLES, EMS_SWITCHES, REQUIRED_ARCH_FIELDS, TRAINED_ROLE_KEYS,
                                         ROLE_HEADS, ROLE_NAMES, SERVED_WEIGHTS, SERVING_ROLES,
                                         RLHFConfig)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _out_of_domain(config: RLHFConfig) -> Dict[str, str]:
    """Every numeric key outside its domain (schema.bounded) -> what is wrong with it."""
    found: Dict[str, str] = {}

    def walk(obj, prefix: str) -> None:
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if dataclasses.is_dataclass(value):
                walk(value, prefix + field.name + ".")
            elif "domain" in field.metadata and isinstance(value, (int, float)) and not isinstance(value, bool):
                problem = field.metadata["domain"].problem(value)
                if problem:
                    found[prefix + field.name] = problem

    walk(config, "")
    return found


def domain_problems(config: RLHFConfig) -> List[str]:
    """Every numeric key outside its domain, each naming file and key."""
    return [f"{config.at(key)}: {problem}" for key, problem in _out_of_domain(config).items()]


def _in_domain(obj, *names: str) -> bool:
    """Whether the bounded keys ``names`` of dataclass ``obj`` (all of its own, without names) are in
    their domains: the checks across keys skip what domain_problems already reported."""
    return not any("domain" in f.metadata and getattr(obj, f.name) is not None and (not names or f.name in names)
                   and f.metadata["domain"].problem(getattr(obj, f.name)) for f in dataclasses.fields(obj))


Problem = Tuple[Tuple[str, ...], str]  # (the keys at fault, what is wrong)


def _feature_problems(m) -> List[Problem]:
    """Combinations of the architecture's features that no model can take."""
    problems: List[Problem] = []
    if m.head_dim is not None and m.head_dim % 2:
        problems.append((("head_dim",), f"RoPE rotates pairs of channels; {m.head_dim} is odd"))
    if m.rope_scaling in ("llama3", "yarn") and m.rope_original_max_position_embeddings is None:
        problems.append((("rope_original_max_position_embeddings",), f"rope_scaling {m.rope_scaling!r} needs it"))
    if m.rope_scaling == "llama3" and m.rope_low_freq_factor >= m.rope_high_freq_factor:
        problems.append((("rope_low_freq_factor", "rope_high_freq_factor"), f"need low < high, got "
                         f"{m.rope_low_freq_factor} and {m.rope_high_freq_factor}"))
    return problems + _expert_problems(m)


def _expert_problems(m) -> List[Problem]:
    family = FAMILIES.get(m.family)
    if family is None:
        return []
    if m.num_experts is None:
        if family.experts:
            return [(("num_experts",), f"family {m.family!r} is a mixture of experts; set num_experts, "
                     "moe_ffn_hidden_size and moe_router_topk")]
        unused = tuple(k for k in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_shared_expert_ffn_hidden_size")
                       if getattr(m, k))
        return [(unused, "set for a model without experts; remove them")] if unused else []
    if not family.experts:
        moe_families = ", ".join(f.name for f in FAMILIES.values() if f.experts)
        return [(("num_experts",), f"family {m.family!r} has no experts (mixtures of experts: {moe_families}); "
                 "remove num_experts or set the family")]
    problems: List[Problem] = []
    if m.moe_ffn_hidden_size is None:
        problems.append((("moe_ffn_hidden_size",), "a model with experts needs each expert's width"))
    if family.experts.shared and m.moe_shared_expert_ffn_hidden_size is None:
        problems.append((("moe_shared_expert_ffn_hidden_size",), f"family {m.family!r} has a shared expert in every "
                         "layer with experts; set its width"))
    if m.moe_router_topk > m.num_experts:
        problems.append((("moe_router_topk",), f"{m.moe_router_topk} is more than num_experts={m.num_experts}"))
    outside = [i for i in m.moe_dense_layers if not 0 <= i < m.num_layers]
    if outside:
        problems.append((("moe_dense_layers",), f"{outside} are not layers of a {m.num_layers}-layer model "
                         f"(valid: 0..{m.num_layers - 1})"))
    return problems


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the checks across keys know of the launch: the world size (None: not known, as in a
    config check without a launch) and the data-parallel size it gives (None: not known or invalid)."""

    world_size: Optional[int]
    dp: Optional[int]


def layout_problems(config: RLHFConfig, world_size: Optional[int] = None) -> List[str]:
    """Every problem of the config's keys together (layouts, networks, batch sizes, algorithm,
    rollout), each naming file, key and what is valid: the values outside their domain first, then
    the world's sizes and every check of CHECKS in order, on a copy where each value already refused
    is at its default and with nothing more said of it (one report per fault, not its consequences)."""
    problems = domain_problems(config)
    if problems:  # the checks below see valid values, and say nothing of a key already reported
        faulty = list(_out_of_domain(config))
        config = _defaults_in_place_of(config, faulty)
        return problems + [p for p in _checks_across_keys(config, world_size) if not any(k in p for k in faulty)]
    return _checks_across_keys(config, world_size)


def _defaults_in_place_of(config: RLHFConfig, keys: List[str]) -> RLHFConfig:
    """A copy of ``config`` with each of ``keys`` at its default (a check never divides by a
    value already refused, nor reports its consequences)."""
    import copy

    config = copy.deepcopy(config)
    for key in keys:
        *path, name = key.split(".")
        owner = config
        for part in path:
            owner = getattr(owner, part)
        field = next(f for f in dataclasses.fields(owner) if f.name == name)
        setattr(owner, name, field.default)
    return config


def _checks_across_keys(config: RLHFConfig, world_size: Optional[int]) -> List[str]:
    problems: List[str] = []
    world, layout = _world_problems(config, world_size)
    if layout is None:  # a size below one: nothing can be checked across keys
        return problems
    problems += world + _unread_keys(config) + _untrained_role_keys(config) + _log_prob_keys(config)
    if config.stage != "rl":  # a stage's batches are of its rows (RL's, of the rollout: _run_problems)
        problems += _stage_problems(config, layout.dp)
    problems += _reward_problems(config) + _algorithm_problems(config)
    missing = [(r, [k for k in REQUIRED_ARCH_FIELDS if getattr(config.role(r).model, k) is None])
               for r in config.model_roles]
    incomplete = [f"{config.source_of(r + '.model')}: {r}.model: missing {', '.join(m)}; set them or name a "
                  "preset (model: {preset: ...})" for r, m in missing if m and f"{r}.model" not in config.refused]
    if any(m for _, m in missing):  # nothing below can be checked without the networks (a refused one said why)
        return problems + incomplete
    for _, check in CHECKS:
        problems += check(config, layout)
    return list(dict.fromkeys(problems))  # a network at two layouts reports its own faults once


def _world_problems(config: RLHFConfig, world_size: Optional[int]) -> Tuple[List[str], Optional[Layout]]:
    """Sequence parallelism, and what the world size must divide; the Layout (None when a size
    is below one)."""
    par, problems = config.parallel, []
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    ep = par.expert_model_parallel_size
    if tp < 1 or pp < 1 or ep < 1:  # nothing below divides by a size that is not one
        return problems, None
    if par.sequence_parallel:
        problems.append(
            f"{config.at('parallel.sequence_parallel')}: not supported yet: it needs transformer-engine's "
            "layers (CUDA) and no PPO run has been checked with it (the engine pads its steps for it, "
            "untried); set it to false"
        )
    dp = None
    cp = par.context_parallel_size
    if world_size is not None:
        if world_size % (tp * pp * cp) != 0:
            key = "parallel.context_parallel_size" if cp > 1 and world_size % (tp * pp) == 0 else "parallel.tensor_model_parallel_size"
            sizes, product = ("TP*PP*CP", f"{tp}*{pp}*{cp}") if cp > 1 else ("TP*PP", f"{tp}*{pp}")
            problems.append(
                f"{config.at(key)}: world size {world_size} is not divisible by "
                f"{sizes} = {product} = {tp * pp * cp}; valid {sizes} for this world size: {_divisors(world_size)}"
            )
        else:
            dp = world_size // (tp * pp * cp)
            if dp % ep != 0:
                problems.append(
                    f"{config.at('parallel.expert_model_parallel_size')}: {ep} does not divide the data-parallel size "
                    f"{dp} (world size {world_size} / {'TP*PP*CP' if cp > 1 else 'TP*PP'} {tp * pp * cp}): megatron takes "
                    f"the expert-parallel ranks from the data-parallel ones; valid EP: {_divisors(dp)}")
    return problems, Layout(world_size, dp)


def _networks(config: RLHFConfig) -> List[tuple]:
    """(network and layout, its ModelArchConfig, the roles that use it): one entry per distinct
    network at a layout, so its faults are reported once, naming every role."""
    networks: List[tuple] = []
    for role in config.model_roles:
        key = (config.role(role).model.network(), config.layout_of(role))
        same = next((n for n in networks if n[0] == key), None)
        if same is None:
            networks.append((key, config.role(role).model, [role]))
        else:
            same[2].append(role)
    return networks


def _network_problems(config: RLHFConfig, layout: Layout) -> List[str]:
    """Each network's architecture against itself and against the layout it runs at."""
    problems: List[str] = []
    par = config.parallel
    networks = _networks(config)
    for (_, own_layout), m, users in networks:
        if not _in_domain(m):
            continue
        role = ", ".join(users)
        at = f"{users[0]}.model"

        def file(field: str) -> str:  # the file that set this field of the network (or its model mapping)
            return config.source_of(f"{at}.{field}")
        tp, pp = own_layout.tensor_model_parallel_size, own_layout.pipeline_model_parallel_size
        ep = own_layout.expert_model_parallel_size
        own = [r for r in users if config.has_own_layout(r)]
        prefix = f"{own[0]}.parallel" if own else "parallel"
        tp_key, pp_key, ep_key = (f"{prefix}.{size}_model_parallel_size" for size in ("tensor", "pipeline", "expert"))
        heads, groups = m.num_attention_heads, m.kv_groups
        if heads % groups != 0:
            problems.append(
                f"{file('num_query_groups')}: {at}.num_query_groups: {groups} does not divide "
                f"num_attention_heads={heads}; valid: {_divisors(heads)}"
            )
        if m.head_dim is None and m.hidden_size % heads != 0:
            problems.append(
                f"{file('hidden_size')}: {at}.hidden_size: {m.hidden_size} is not divisible by "
                f"num_attention_heads={heads}; set head_dim for heads of another width"
            )
        problems.extend(f"{config.source_of(f'{at}.{keys[0]}')}: {at}.{', '.join(keys)}: {text}"
                        for keys, text in _feature_problems(m))
        if heads % tp != 0:
            problems.append(
                f"{config.at(tp_key)}: {tp} does not divide {role}'s "
                f"num_attention_heads={heads} ({file('num_attention_heads')}); valid TP: {_divisors(heads)}"
            )
        elif groups % tp != 0:
            problems.append(
                f"{config.at(tp_key)}: {tp} does not divide {role}'s "
                f"num_query_groups={groups} (grouped-query attention, {file('num_query_groups')}); valid TP: "
                f"{_divisors(groups)}"
            )
        if m.ffn_hidden_size % tp != 0:
            problems.append(
                f"{config.at(tp_key)}: {tp} does not divide {role}'s "
                f"ffn_hidden_size={m.ffn_hidden_size} ({file('ffn_hidden_size')})"
            )
        if m.num_layers % pp != 0:
            problems.append(
                f"{config.at(pp_key)}: {pp} does not divide {role}'s "
                f"num_layers={m.num_layers} ({file('num_layers')}); valid PP: {_divisors(m.num_layers)}"
            )
        if m.num_experts and m.moe_ffn_hidden_size:
            if m.num_experts % ep != 0:
                problems.append(f"{config.at(ep_key)}: {ep} does not divide {role}'s num_experts={m.num_experts} "
                                f"({file('num_experts')}); valid EP: {_divisors(m.num_experts)}")
            for width in ("moe_ffn_hidden_size", "moe_shared_expert_ffn_hidden_size"):
                if (getattr(m, width) or 0) % tp != 0:
                    problems.append(f"{config.at(tp_key)}: {tp} does not divide {role}'s {width}={getattr(m, width)} "
                                    f"({file(width)}); each expert is split over TP")
            trained = [r for r in users if r in config.trainable_roles]
            if trained and tp > 1:
                problems.append(f"{config.at(tp_key)}: {tp}, but {', '.join(trained)} trains a model with experts "
                                f"({file('num_experts')}): megatron-core trains MoE layers at TP > 1 only with "
                                "sequence parallelism, which these runs do not use; split the model with expert_model_parallel_size and "
                                "pipeline_model_parallel_size at tensor_model_parallel_size: 1")
    if par.expert_model_parallel_size > 1 and not any(n[1].num_experts for n in networks):
        problems.append(f"{config.at('parallel.expert_model_parallel_size')}: {par.expert_model_parallel_size}, but no "
                        "role's model has experts; set it to 1")
    return problems


def _served_weight_problems(config: RLHFConfig, layout: Layout) -> List[str]:
    """Weight sync copies or shares trained weights into the serving role: the same network."""
    return [f"{config.source_of(trained + '.model')}: {trained}.model: differs from {serving}.model "
            f"({config.source_of(serving + '.model')}); weight sync needs the same architecture"
            for serving, trained in config.served_weights.items()
            if config.role(trained).model.network() != config.role(serving).model.network()]


def _role_layout_problems(config: RLHFConfig, world_size: Optional[int]) -> List[str]:
    """The serving roles' own layouts (``<role>.parallel``): who may have one, and what it must divide."""
    problems = []
    for role in config.roles:
        own = config.role(role).parallel
        if all(getattr(own, f.name) is None for f in dataclasses.fields(own)):
            continue
        at = config.at(f"{role}.parallel")
        if role in config.trainable_roles:
            problems.append(f"{at}: {role} is trained, and trained roles run at the run's layout (parallel.*); "
                            f"serving roles may have their own: {', '.join(SERVING_ROLES)}")
            continue
        if role not in config.model_roles:
            problems.append(f"{at}: the reward is no model here (reward.type: {config.reward.type}): nothing to lay out")
            continue
        layout = config.layout_of(role)
        tp, pp, ep = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.expert_model_parallel_size
        arch = config.role(role).model
        if own.expert_model_parallel_size and not arch.num_experts:
            problems.append(f"{at}.expert_model_parallel_size: {role}'s model has no experts; remove it")
        if world_size is not None and world_size % (tp * pp):
            problems.append(f"{at}: TP*PP = {tp}*{pp} does not divide the world size {world_size}; valid TP*PP: "
                            f"{_divisors(world_size)}")
        elif world_size is not None:
            dp = world_size // (tp * pp)
            if config.rollout_samples % dp:
                problems.append(f"{at}: {role}'s data-parallel size {dp} does not divide the rollout's "
                                f"{config.rollout_samples} responses (ppo.rollout_batch_size x samples_per_prompt)")
            if arch.num_experts and dp % ep:
                problems.append(f"{at}: EP {ep} does not divide {role}'s data-parallel size {dp} (megatron takes the "
                                f"expert-parallel ranks from the data-parallel ones); valid EP: {_divisors(dp)}")
        if role == "policy" and config.moe.routing_replay != "off" and \
                pp != config.parallel.pipeline_model_parallel_size:
            problems.append(f"{config.at(role + '.parallel.pipeline_model_parallel_size')}: PP {pp}, but "
                            f"moe.routing_replay: {config.moe.routing_replay} records each pipeline stage's layers: "
                            "replay needs the policy at the trained layout's PP "
                            f"({config.parallel.pipeline_model_parallel_size}); set the PP alike or routing_replay: off")
        if arch.vocab_size and config.padded_vocab(arch) % tp:
            problems.append(f"{at}: TP {tp} does not divide the padded vocabulary {config.padded_vocab(arch)} (padded "
                            "for the run's TP, so that every layout exchanges weights with the trained roles)")
        if role not in SERVED_WEIGHTS and config.role(role).load is None:
            problems.append(f"{at}: {role} at its own layout needs {role}.load: seeded weights are drawn per shard, so "
                            "they would not equal the trained roles' at the run's layout")
        if role in ("reward", "judge") and config.trainer.val_interval:
            problems.append(f"{at}: with validation (trainer.val_interval) the {role} model runs at the run's "
                            f"layout: validation's chunks differ from rank to rank; remove {role}.parallel or validation")
    return problems


def weight_sharing_notes(config: RLHFConfig) -> List[str]:
    """Where a serving role shares its trained role's weight storage, the weights leave the device
    by either role's ``offload_weights``: say so when the two switches differ (not an error)."""
    notes = []
    for serving in config.served_weights:
        owner = config.weight_owner(serving) if serving in config.model_roles else None
        if owner is None:
            continue
        if "auto" in (config.role(serving).free_memory, config.role(owner).free_memory):
            continue  # chosen at start-up
        mine, theirs = (config.role(r).ems_switch("offload_weights") for r in (serving, owner))
        if mine != theirs:
            who, other = (serving, owner) if mine else (owner, serving)
            notes.append(
                f"{serving} shares {owner}'s weight storage, so {who}'s offload_weights=True moves the "
                f"weights of both off the device after {who} runs, although {other}'s is False "
                f"({config.at(who + '.free_memory')})"
            )
    return notes


def _routing_replay_problems(config: RLHFConfig) -> List[str]:
    """Routing replay needs a policy with experts, and a training forward that runs once (a
    recomputed forward would ask the router again, out of the record's order)."""
    mode = config.moe.routing_replay
    if mode == "off":
        return []
    if not config.policy.model.num_experts:
        return [f"{config.at('moe.routing_replay')}: {mode}, but the policy has no experts "
                f"({config.source_of('policy.model')}); set it to off"]
    if config.ppo_policy.recompute_activations:
        return [f"{config.at('ppo_policy.recompute_activations')}: true cannot be used with moe.routing_replay: {mode} "
                "(the recomputed forward would route again); set it to false, or moe.routing_replay: off"]
    return []


def _fixed_address_problems(config: RLHFConfig) -> List[str]:
    """megatron settings that need a role's device storages at fixed addresses, where EMS moves them."""
    problems: List[str] = []
    for role in config.model_roles:
        rc = config.role(role)
        # What moves this role's storages: its own switches, and the offload_weights of a serving
        # role that shares its weights.
        sharing = [s for s in config.served_weights if s in config.model_roles and config.weight_owner(s) == role]
        # free_memory: auto may turn any switch on.
        moving = [f"{role}.{k}" for k in EMS_SWITCHES if rc.ems_switch(k, auto=True)] + [
            f"{s}.offload_weights" for s in sharing if config.role(s).ems_switch("offload_weights", auto=True)]
        settings = [("cuda_graph_impl", rc.cuda_graph_impl, "none",
                     "CUDA graphs replay the device addresses they captured"),
                    ("nccl_ub", rc.nccl_ub, False, "NCCL registers DDP's buffers once, at their first address")]
        for key, value, default, why in settings:
            if value != default and moving:
                problems.append(
                    f"{config.at(role + '.' + key)}: {value!r} cannot be used with EMS: {why}, and EMS frees and "
                    f"re-allocates them ({', '.join(moving)} on); set {key}: {default!r}, or turn those switches off "
                    f"({', '.join(sorted({m.split('.')[0] + '.free_memory' for m in moving}))}: false)")
        if rc.overlap_param_gather:
            served = next((s for s, t in config.served_weights.items() if t == role), None)
            reader = f"the serving role {served} reads {role}'s weights right after the optimizer step" if served                 else "EMS moves the buffer it gathers into"
            problems.append(
                f"{config.at(role + '.overlap_param_gather')}: true is not supported: megatron defers the all-gather "
                f"of the updated weights to {role}'s next forward, but {reader}; set overlap_param_gather: false "
                "(overlap_grad_reduce overlaps the gradient reduction instead)")
        if rc.min_lr != 0:
            problems.append(f"{config.at(role + '.min_lr')}: {rc.min_lr:g}, but there is no learning-rate schedule: "
                            f"{role}.lr holds for the whole run; remove min_lr")
    return problems


def _context_parallel_problems(config: RLHFConfig) -> List[str]:
    """parallel.context_parallel_size > 1 where its numbers are shown equal to CP=1's (every stage's
    loss over dense models); what it does not cover yet is refused by name."""
    cp = config.parallel.context_parallel_size
    if cp == 1:
        return []
    at, problems = config.at("parallel.context_parallel_size"), []
    if config.trainer.batch_invariant:
        problems.append(f"{at}: {cp}: trainer.batch_invariant covers whole rows on one rank; set CP to 1")
    for role in config.model_roles:
        rc = config.role(role)
        if config.has_own_layout(role):
            problems.append(f"{at}: {cp}: {role}.parallel: a role's own layout beside CP is not modelled yet; remove it")
        if rc.attention != "fused":
            problems.append(f"{at}: {cp} needs {role}.attention: fused (megatron's local attention refuses CP)")
        if rc.model.num_experts:
            problems.append(f"{at}: {cp}: {role}'s model has experts, not yet run beside CP (dense models only)")
    return problems


def _packed_rows_problems(config: RLHFConfig) -> List[str]:
    """pack_rows where packed passes are shown equal to padded ones; the judge (it only generates)
    and what packing does not cover yet are refused by name."""
    problems = []
    for role in config.roles:
        if not config.role(role).pack_rows:
            continue
        rc, at = config.role(role), config.at(role + ".pack_rows")
        if role == "judge":
            problems.append(f"{at}: the judge only generates (its KV cache holds no padding to drop); remove it")
        if config.parallel.context_parallel_size > 1:
            problems.append(f"{at}: packed rows beside context parallelism (CP={config.parallel.context_parallel_size}) "
                            "are not modelled yet; set one of them off")
        if config.trainer.batch_invariant:
            problems.append(f"{at}: trainer.batch_invariant computes right-padded rows; set pack_rows false")
        if rc.attention != "fused":
            problems.append(f"{at}: needs {role}.attention: fused (megatron's local attention refuses packed rows)")
    return problems


def _batch_invariant_problems(config: RLHFConfig) -> List[str]:
    """trainer.batch_invariant where its arithmetic is shown (models/batch_invariant.py): what it
    does not cover is refused by name."""
    if not config.trainer.batch_invariant:
        return []
    at, problems = config.at("trainer.batch_invariant"), []
    for role in config.model_roles:
        rc, layout = config.role(role), config.layout_of(role)
        if layout.tensor_model_parallel_size != 1:
            problems.append(f"{at}: true needs TP=1 ({role} runs at TP={layout.tensor_model_parallel_size}): the engine's "
                            "gathered vocabulary and the trainer's shards would sum the softmax in other orders")
        if rc.model.num_experts:
            problems.append(f"{at}: true covers dense models; {role}'s has experts")
        if rc.attention != "fused":
            problems.append(f"{at}: true needs {role}.attention: fused (megatron's local attention is not row-invariant)")
        if config.lora_of(role).rank:
            problems.append(f"{at}: true does not cover LoRA's adapter products ({role} has adapters)")
    return problems


def _reward_problems(config: RLHFConfig) -> List[str]:
    reward = config.reward
    problems = []
    if reward.type == "function":
        if reward.function is not None and reward.functions is not None:
            return [f"{config.at('reward.functions')}: set together with reward.function; name one function there, or "
                    "every function with its weight here"]
        if "reward.functions" in config.refused:
            return []  # given, but not a mapping of weights: the loader has said so
        specs = [reward.function] if reward.functions is None else list(reward.functions)
        key = "reward.function" if reward.functions is None else "reward.functions"
        for spec in specs:
            if not spec or ":" not in spec:
                problems.append(f"{config.at(key)}: reward.type is 'function', so name the rule as 'module:callable' or "
                                f"'file.py:callable', got {spec!r}")
    else:
        for key in ("function", "functions"):
            if getattr(reward, key) is not None:
                problems.append(f"{config.at('reward.' + key)}: set, but reward.type is {reward.type!r}; set "
                                "reward.type: function to use it, or remove it")
    problems += _process_reward_problems(config)
    if reward.type == "judge" and config.stage == "rl" and not config.judge.enabled:
        problems.append(f"{config.at('reward.type')}: judge, but judge.enabled is false: nothing scores the "
                        "responses; enable the judge, or choose a reward (model or function)")
    return problems + _judge_problems(config)


def _process_reward_problems(config: RLHFConfig) -> List[str]:
    """A process reward model in RL (reward.step_separator): a model, and token rewards only where an
    estimator reads per-token rewards."""
    reward, at = config.reward, config.at
    if reward.step_separator is None:
        if "reward.step_aggregation" not in config.origin:
            return []
        return [f"{at('reward.step_aggregation')}: set, but reward.step_separator is not: the reward model is an "
                "outcome model; give the separator its steps end with"]
    problems = []
    if config.stage != "rl":
        return problems
    if reward.type != "model":
        problems.append(f"{at('reward.step_separator')}: a process reward model's steps, but reward.type is "
                        f"{reward.type}; set type: model (a checkpoint of stage prm)")
    if not reward.step_separator:
        problems.append(f"{at('reward.step_separator')}: empty; the steps end with it")
    if reward.normalize:
        problems.append(f"{at('reward.normalize')}: a process reward model's step scores are probabilities; remove it")
    estimator = config.algorithm.advantage_estimator
    if reward.step_aggregation == "token" and estimator not in TOKEN_REWARD_ESTIMATORS:
        problems.append(f"{at('reward.step_aggregation')}: token rewards at the steps' ends, but {estimator} reads one "
                        f"outcome per response; use {', '.join(TOKEN_REWARD_ESTIMATORS)}, or aggregate (min, last, mean)")
    if reward.step_aggregation == "token":
        problems += [f"{at(key)}: clips or scales the response's score; with token rewards at the steps' ends there is "
                     "none: remove it" for key in ("ppo.reward_clip", "ppo.normalize_reward") if key in config.origin
                     and getattr(config.ppo, key.split(".")[1])]
    return problems


def judge_template_problem(template: str) -> Optional[str]:
    """What is wrong with a judge's template (None: nothing): it must show the response."""
    if "{response}" not in template:
        return (f"the judge's template never shows the response: write {{response}} where it goes (fields: "
                f"{', '.join('{' + f + '}' for f in JUDGE_FIELDS)})")
    return None


def _judge_messages_problems(config: RLHFConfig) -> List[str]:
    """judge.messages: chat messages of known roles, through the chat template, the response shown."""
    at, messages = config.at("judge.messages"), config.judge.messages
    if not config.data.apply_chat_template:
        return [f"{at}: chat messages go through the tokenizer's chat template: set data.apply_chat_template: true, "
                "or give the prompt as judge.template"]
    bad = [f"{at}: message {i}: role {m.get('role')!r} is not one of {', '.join(CHAT_ROLES)}, or it has no content"
           for i, m in enumerate(messages) if m.get("role") not in CHAT_ROLES or "content" not in m]
    if not messages or bad:
        return bad or [f"{at}: empty; give at least one message"]
    problem = judge_template_problem("".join(m["content"] for m in messages))
    return [f"{at}: {problem}"] if problem else []


def _judge_problems(config: RLHFConfig) -> List[str]:
    """The judge's template, parser and sampling (rewards/verdicts.py reads them)."""
    judge = config.judge
    if not judge.enabled:
        return _set_while_off(config, "judge", "judge.enabled", "false", "set judge.enabled: true to judge the "
                              "responses, or remove it") if config.stage == "rl" else []
    problems = []
    given = [k for k in ("template", "template_file", "messages") if getattr(judge, k) is not None]
    if len(given) != 1:
        problems.append(f"{config.at('judge.template')}: give the judge's prompt as judge.template (text with "
                        "{prompt}, {response}, {reference}), judge.template_file or judge.messages, one of them"
                        + (f"; given: {', '.join(given)}" if given else ""))
    elif judge.template is not None:
        problem = judge_template_problem(judge.template)
        if problem:
            problems.append(f"{config.at('judge.template')}: {problem}")
    elif judge.messages is not None:
        problems += _judge_messages_problems(config)
    if judge.parser == "choice" and not judge.choices:
        problems.append(f"{config.at('judge.choices')}: judge.parser is choice: give the verdict words and their "
                        "scores, e.g. {A: 1.0, B: 0.0}")
    if (judge.parser == "function") != (judge.parser_function is not None):
        problems.append(f"{config.at('judge.parser_function')}: " + (
            "judge.parser is function: name it as 'module:callable' or 'file.py:callable'" if judge.parser == "function"
            else f"set, but judge.parser is {judge.parser}; it is read by parser: function"))
    elif judge.parser_function is not None and ":" not in judge.parser_function:
        problems.append(f"{config.at('judge.parser_function')}: name it as 'module:callable' or 'file.py:callable', "
                        f"got {judge.parser_function!r}")
    if judge.parser != "choice" and "judge.choices" in config.origin:
        problems.append(f"{config.at('judge.choices')}: set, but judge.parser is {judge.parser}; choices are read by "
                        "parser: choice")
    low_high = judge.score_range
    if judge.parser in ("choice", "function") and "judge.score_range" in config.origin:
        problems.append(f"{config.at('judge.score_range')}: set, but judge.parser is {judge.parser}: the range is "
                        "read by number and boxed")
    elif len(low_high) != 2 or not low_high[0] < low_high[1]:
        problems.append(f"{config.at('judge.score_range')}: must be [low, high] with low < high, got {low_high}")
    if judge.samples == 1:
        problems += [f"{config.at('judge.' + k)}: set, but judge.samples is 1 (one greedy verdict); sample more "
                     "verdicts to use it, or remove it" for k in ("combine", "temperature") if f"judge.{k}" in config.origin]
    return problems


def _algorithm_problems(config: RLHFConfig) -> List[str]:
    """The estimator's roles and the settings of group sampling, KL, clipping and reward shaping."""
    problems: List[str] = []
    alg, gen, ppo = config.algorithm, config.generation, config.ppo
    estimator = alg.advantage_estimator

    def bad(key: str, message: str) -> None:
        problems.append(f"{config.at(key)}: {message}")

    needs = ", ".join(config.roles)
    if config.critic_free:
        for role in CRITIC_ROLES:
            if role in config.origin:  # named where its entry is (not its model file)
                entry = next(k for k in (role + ".model_config_file", role) if k in config.origin)
                problems.append(
                    f"{config.source_of(entry)}: {role}: configured, but algorithm.advantage_estimator={estimator} "
                    f"has no critic: it runs {needs}; remove {' and '.join(CRITIC_ROLES)} (or use advantage_estimator: gae)")
    if gen.samples_per_prompt < 2 and estimator in GROUP_ESTIMATORS:
        bad("generation.samples_per_prompt", f"{estimator} compares the responses to one prompt with each other; "
            "set samples_per_prompt >= 2 (4 to 16 is usual)")
    elif gen.samples_per_prompt < 2 and alg.dynamic_sampling:
        bad("algorithm.dynamic_sampling", "drops groups whose responses all score the same, so it needs "
            "generation.samples_per_prompt >= 2")
    if gen.samples_per_prompt > 1 and gen.greedy:
        bad("generation.samples_per_prompt", "greedy decoding gives every response to a prompt the same "
            "tokens; sample (greedy: false) or use samples_per_prompt: 1")
    budget = config.model_token_budget
    if budget >= 1 and alg.overlong_buffer_length >= budget:
        what = "rollout.max_turns x the turn's tokens" if config.rollout.multi_turn else "generation.max_new_tokens"
        bad("algorithm.overlong_buffer_length", f"must be below the model's tokens per response ({what} = {budget}), "
            f"got {alg.overlong_buffer_length}")
    low = ppo.clip_range[0]
    if low >= 1:
        bad("ppo.clip_ratio_low" if ppo.clip_ratio_low is not None else "ppo.clip_ratio",
            f"the ratio is clipped below at 1 - {low}, which must stay above 0; use a value < 1")
    needed, why = LOSS_AGG_MODE_OF.get(ppo.policy_loss, (ppo.loss_agg_mode, ""))
    if ppo.loss_agg_mode != needed:
        bad("ppo.loss_agg_mode", f"{why}; set ppo.loss_agg_mode: {needed} (got {ppo.loss_agg_mode})")
    return problems


def _run_problems(config: RLHFConfig, dp: Optional[int]) -> List[str]:
    """Data, generation and PPO batch settings."""
    problems: List[str] = []
    ppo, gen, data = config.ppo, config.generation, config.data

    def bad(key: str, message: str) -> None:
        problems.append(f"{config.at(key)}: {message}")

    if data.system_prompt is not None and not data.apply_chat_template:
        bad("data.system_prompt", "set, but data.apply_chat_template is false: a system message is rendered by the "
            "chat template; set apply_chat_template: true, or put the text in the prompts")
    if data.tokenizer.type == "char":
        for key in ("eos_token", "eos_tokens", "pad_token", "path"):
            if f"data.tokenizer.{key}" in config.origin and getattr(data.tokenizer, key):
                bad(f"data.tokenizer.{key}", "set, but the char tokenizer has fixed special tokens and no file; "
                    "remove it, or use type: hf")
    if (gen.top_k or gen.top_p < 1) and not gen.greedy:
        key = "generation.top_k" if gen.top_k else "generation.top_p"
        bad(key, "PPO's ratios need the log-probs of the distribution the rollout sampled from, and "
            "those are computed over the full vocabulary (after temperature); truncated sampling would "
            "make the old log-probs those of another distribution. Set top_k: 0 and top_p: 1.0")
    if data.tokenizer.type == "char" and data.tokenizer.path:
        bad("data.tokenizer.path", "set, but the tokenizer type is 'char'; set type: hf or remove it")
    if data.tokenizer.type == "char" and data.apply_chat_template:
        bad("data.apply_chat_template", "the char tokenizer has no chat template; use a Hugging Face tokenizer (type: hf)")
    trainer = config.trainer
    if (trainer.val_interval or trainer.val_before_train) and not data.val_file:
        key = "trainer.val_interval" if trainer.val_interval else "trainer.val_before_train"
        bad(key, "validation needs data.val_file")
    if trainer.val_samples_per_prompt > 1 and trainer.val_greedy:
        bad("trainer.val_samples_per_prompt", f"{trainer.val_samples_per_prompt} greedy responses to a prompt are "
            "all the same; set trainer.val_greedy: false to sample them (pass@k needs distinct tries)")
    longest = config.sequence_tokens if _in_domain(config.rollout) else 0
    for role in config.model_roles:
        limit = config.role(role).model.max_position_embeddings
        if longest > limit:
            key, what = ("rollout.max_trajectory_tokens", "a trajectory's tokens") if config.rollout.multi_turn else (
                "data.max_prompt_length", "max_prompt_length + generation.max_new_tokens")
            if config.stage != "rl":  # a stage bounds its rows by max_length
                key, what = f"{config.stage}.max_length", "max_length"
            bad(key, f"{what} = {longest} exceeds {role}'s max_position_embeddings={limit}")
            break
    if config.stage != "rl" or dp is None or problems or not (_in_domain(ppo, "rollout_batch_size") and
                                                              _in_domain(gen, "samples_per_prompt")):
        return problems  # a stage's batches: _stage_problems
    if ppo.rollout_batch_size % dp:
        bad("ppo.rollout_batch_size", f"{ppo.rollout_batch_size} is not divisible by DP = {dp}")
        return problems
    per_rank = config.rollout_samples // dp
    rollout = f"ppo.rollout_batch_size={ppo.rollout_batch_size}"
    if gen.samples_per_prompt > 1:
        rollout += f" x generation.samples_per_prompt={gen.samples_per_prompt}"
    for role in (r for r in config.model_roles if _in_domain(config.role(r), "micro_batch_size", "global_batch_size")):
        rc = config.role(role)
        if role in config.trainable_roles:
            step = config.samples_per_step(role)
            if config.rollout_samples % step:
                bad(
                    f"{role}.global_batch_size",
                    f"{step} does not divide the rollout of {config.rollout_samples} samples ({rollout}); "
                    "each PPO epoch splits the rollout into optimizer steps of this size",
                )
            elif rc.micro_batch_size != "auto" and step % (rc.micro_batch_size * dp):
                split = rc.micro_batch_size * dp
                bad(
                    f"{role}.global_batch_size" if rc.global_batch_size is not None else f"{role}.micro_batch_size",
                    f"{step} is not divisible by micro_batch_size*DP = {rc.micro_batch_size}*{dp} = {split}; "
                    f"use a multiple of {split}",
                )
        elif rc.micro_batch_size != "auto" and per_rank % rc.micro_batch_size:
            bad(
                f"{role}.micro_batch_size",
                f"{rc.micro_batch_size} does not divide the per-rank rollout of {per_rank} samples "
                f"({rollout} / DP={dp})",
            )
    return problems


def _token_budget_problems(config: RLHFConfig, role: str) -> List[str]:
    """``micro_batch_size: auto`` goes with ``max_tokens_per_micro_batch`` (and the budget with
    auto), and holds the longest row."""
    rc, where = config.role(role), config.at
    budget = rc.max_tokens_per_micro_batch
    if rc.micro_batch_size != "auto":
        return [f"{where(role + '.max_tokens_per_micro_batch')}: set, but {role}.micro_batch_size is "
                f"{rc.micro_batch_size} rows; set micro_batch_size: auto to pack micro-batches by tokens"] if budget else []
    if budget is None:
        return [f"{where(role + '.micro_batch_size')}: auto packs micro-batches by tokens; set "
                f"{role}.max_tokens_per_micro_batch (e.g. {4 * config.sequence_tokens})"]
    problems = []
    if _in_domain(config.rollout) and budget < config.sequence_tokens:
        problems.append(f"{where(role + '.max_tokens_per_micro_batch')}: {budget} is below the longest row a rollout "
                        f"holds ({config.sequence_tokens} tokens); use at least {config.sequence_tokens}")
    return problems


def _rollout_problems(config: RLHFConfig) -> List[str]:
    """Multi-turn settings need an environment (never silently unused), and its trajectories are
    generated at the run's layout (the environment's rows are those of the run's cut)."""
    r = config.rollout
    if not r.multi_turn:
        unused = sorted(k for k in config.origin if k.startswith("rollout.") and k != "rollout.environment"
                        and k.split(".")[1] != "partial")
        return [f"{config.at(k)}: set, but neither rollout.environment nor rollout.tools is: multi-turn settings need "
                "an environment (module:Class or file.py:Class) or tools; remove it or name one" for k in unused]
    problems = []
    if config.generation.ignore_eos:
        problems.append(f"{config.at('generation.ignore_eos')}: a multi-turn rollout's turns end at their end tokens; "
                        "ignore_eos is for single-turn rollouts")
    tools_key = "rollout.tools" if r.tools else "rollout.mcp_servers"
    if r.uses_tools and r.environment:
        problems.append(f"{config.at(tools_key)}: the tools run in the built-in tool environment; a custom "
                        f"rollout.environment ({r.environment}) calls its own tools: set one of the two")
    if r.uses_tools and r.tool_timeout_s >= r.env_timeout_s:
        problems.append(f"{config.at('rollout.tool_timeout_s')}: {r.tool_timeout_s:g}s must stay below "
                        f"rollout.env_timeout_s={r.env_timeout_s:g}s (a step's bound, its calls included)")
    tool_keys = ("tool_parser", "max_parallel_calls", "tool_timeout_s")
    for k in tool_keys:
        if not r.uses_tools and f"rollout.{k}" in config.origin:
            problems.append(f"{config.at('rollout.' + k)}: set, but rollout.tools is empty; name the tools or remove it")
    problems += _sandbox_problems(config)
    if any(not isinstance(text, str) or not text for text in r.stop):
        problems.append(f"{config.at('rollout.stop')}: {r.stop!r} holds an empty string (or one that is not text), "
                        "which would end every turn at its first token; remove it")
    if r.uses_tools and r.tool_parser not in PLAIN_TEXT_PARSERS and not config.data.apply_chat_template:
        problems.append(f"{config.at('rollout.tool_parser')}: {r.tool_parser} calls are shown to the model through the "
                        f"chat template's tools; set data.apply_chat_template: true (or use the {PLAIN_TEXT_PARSERS[0]} "
                        "parser)")
    if r.trajectory_tokens(config.data, config.generation) < config.data.max_prompt_length + 1:
        problems.append(f"{config.at('rollout.max_trajectory_tokens')}: {r.max_trajectory_tokens} leaves no room for "
                        f"a turn after a prompt of data.max_prompt_length={config.data.max_prompt_length}")
    return problems


def _sandbox_problems(config: RLHFConfig) -> List[str]:
    """rollout.sandbox is the tool environment's (a custom environment runs its own code); each
    kind's own keys only with that kind; a remote sandbox needs its service's URL."""
    s = config.rollout.sandbox
    given = sorted(k for k in config.origin if k.startswith("rollout.sandbox."))
    if given and not config.rollout.uses_tools:
        return [f"{config.at(given[0])}: rollout.sandbox is the Python tool's of rollout.tools, and no tools are named; "
                "a custom environment runs code through run_python(code, SandboxConfig(...)) itself: remove it"]
    problems = []
    problems += [f"{config.at('rollout.sandbox.' + k)}: set, but rollout.sandbox.kind is {s.kind}; it is read by "
                 f"kind {' and '.join(kinds)} only: remove it" for k, kinds in SANDBOX_KIND_KEYS.items()
                 if s.kind not in kinds and f"rollout.sandbox.{k}" in config.origin]
    if s.wall_s + 1 > config.rollout.tool_timeout_s:
        problems.append(f"{config.at('rollout.sandbox.wall_s')}: {s.wall_s:g}s must stay at least a second below "
                        f"rollout.tool_timeout_s={config.rollout.tool_timeout_s:g}s, so that the sandbox stops the code "
                        "and says why before the tool's time-out cuts the call off")
    if s.remote and not (s.url or "").startswith(("http://", "https://")):
        problems.append(f"{config.at('rollout.sandbox.url')}: kind remote needs the SandboxFusion service's base URL "
                        f"(http://host:port), got {s.url!r}")
    return problems


def _set_while_off(config: RLHFConfig, section: str, switch: str, off: str, advice: str) -> List[str]:
    """Each key under ``section`` given in a file while the feature's ``switch`` key is ``off``:
    never silently unused."""
    keys = [k for k in sorted(config.origin) if k.startswith(section + ".") and k != switch]
    return [f"{config.at(k)}: set, but {switch} is {off}; {advice}" for k in keys
            if k.rpartition(".")[0] not in keys]  # a list's or section's own keys said once, by it


def _partial_problems(config: RLHFConfig, layout: Layout) -> List[str]:
    """Partial rollouts and rollout correction: never silently unused (a chunk counted in tokens
    single-turn, in turns with an environment), generated by an engine that can record the
    behaviour log-probs, with a pool that splits over every DP layout of the policy."""
    partial, correction, problems = config.rollout.partial, config.algorithm.rollout_correction, []
    if not partial.enabled:
        problems += _set_while_off(config, "rollout.partial", "rollout.partial.enabled", "false",
                                   "enable partial rollouts or remove it")
    if correction.mode == "off":
        problems += _set_while_off(config, "algorithm.rollout_correction", "algorithm.rollout_correction.mode", "off",
                                   "choose truncate or mask, or remove it")
    elif correction.threshold_low is not None and correction.mode == "truncate":
        problems.append(f"{config.at('algorithm.rollout_correction.threshold_low')}: only mask keeps a band; "
                        "truncate caps the weight at threshold; remove it or use mode: mask")
    elif correction.band[0] >= correction.band[1]:
        problems.append(f"{config.at('algorithm.rollout_correction.threshold_low')}: {correction.band[0]:g} must be "
                        f"below threshold={correction.threshold:g} (the band of ratios kept)")
    if partial.enabled and config.rollout.multi_turn and partial.chunk_tokens is not None:
        problems.append(f"{config.at('rollout.partial.chunk_tokens')}: with an environment a trajectory is held at a "
                        "turn's start, so a chunk is counted in turns: set rollout.partial.chunk_turns instead")
    if partial.enabled and not config.rollout.multi_turn and partial.chunk_turns is not None:
        problems.append(f"{config.at('rollout.partial.chunk_turns')}: counts turns of trajectories with an environment, "
                        "and this run has none: set rollout.partial.chunk_tokens instead")
    if not partial.enabled:
        return problems
    if config.moe.routing_replay == "rollout":
        problems.append(f"{config.at('moe.routing_replay')}: rollout records the experts of one generate() call, and a "
                        "held response is generated over several iterations; use old_logprob with partial rollouts")
    policy = config.layout_of("policy")
    if config.policy.model.num_experts and policy.expert_model_parallel_size > 1:
        problems.append(f"{config.at('rollout.partial.enabled')}: not supported with expert parallelism yet (a replica "
                        "whose responses all ended would leave its expert peers' generation); set EP 1 or disable it")
    rows = partial.pool_groups(config.ppo.rollout_batch_size) * config.generation.samples_per_prompt
    if layout.world_size is not None:
        sizes = {layout.dp}
        tp, pp = policy.tensor_model_parallel_size, policy.pipeline_model_parallel_size
        if layout.world_size % (tp * pp) == 0:
            sizes.add(layout.world_size // (tp * pp))
        for dp in sorted(d for d in sizes if d and rows % d):
            problems.append(f"{config.at('rollout.partial.over_sample')}: {partial.over_sample:g} x "
                            f"ppo.rollout_batch_size={config.ppo.rollout_batch_size} = "
                            f"{partial.pool_groups(config.ppo.rollout_batch_size)} prompts in flight, x samples_per_prompt="
                            f"{config.generation.samples_per_prompt} = {rows} responses, do not split over "
                            f"DP={dp}; choose over_sample so that they do")
    return problems


def _lora_problems(config: RLHFConfig) -> List[str]:
    """LoRA goes on a trained role (its serving role runs the same adapters), with targets that
    exist, no dropout and no experts' linears; a PEFT adapter (load_lora) on a trained policy's."""
    problems = []
    policies = [r for r in config.trainable_roles if ROLE_HEADS[r] == "lm"]  # the roles a PEFT adapter starts
    for role in config.model_roles:
        lora = config.role(role).lora
        load_lora = config.role(role).load_lora
        if load_lora and (role not in policies or not lora.enabled):
            problems.append(f"{config.at(role + '.load_lora')}: a PEFT adapter starts {' or '.join(policies) or 'a trained policy'}'s "
                            "LoRA adapters " + ("(set its lora: rank, alpha and target_modules as the adapter's)"
                                                if role in policies else f"(a language model's); {role} takes none: remove it"))
        if not lora.enabled:
            problems += _set_while_off(config, f"{role}.lora", f"{role}.lora.rank", "0 (off)", "set a rank or remove it")
            continue
        at = config.at(f"{role}.lora")
        if role not in config.trainable_roles:
            trained = config.served_weights.get(role)
            problems.append(f"{at}: {role} is not trained" + (f"; it runs {trained}'s adapters: set {trained}.lora"
                                                               if trained else f"; adapters go on {' or '.join(config.trainable_roles)}"))
            continue
        if lora.dropout:
            problems.append(f"{config.at(role + '.lora.dropout')}: {lora.dropout:g}, but RL needs the log-probs of "
                            "the rollout and of training to be those of one network: adapter dropout must be 0")
        unknown = sorted(set(lora.target_modules) - set(LORA_TARGETS))
        if unknown or not lora.target_modules:
            problems.append(f"{config.at(role + '.lora.target_modules')}: {unknown or 'empty'}; choose among "
                            f"{', '.join(LORA_TARGETS)}")
        mlp = sorted({"linear_fc1", "linear_fc2"} & set(lora.target_modules))
        if config.role(role).model.num_experts and mlp:
            problems.append(f"{config.at(role + '.lora.target_modules')}: {', '.join(mlp)} are the experts' linears in "
                            "a model with experts, which adapters do not support yet; target linear_qkv, linear_proj")
    return problems



def _stage_problems(config: RLHFConfig, dp: Optional[int]) -> List[str]:
    """A stage before RL (sft, rm, dpo): its trained role's
    step (global_batch_size samples: rows, or pairs) cut into micro-batches and DP shares; what the
    stages do not support yet (LoRA, a role's own layout, a reward function) refused."""
    stage, trained = config.stage, config.trainable_roles[0]
    problems = []
    rc, where = config.role(trained), config.at
    unit = config.sample_unit
    if rc.global_batch_size is None:
        problems.append(f"{where(trained + '.global_batch_size')}: not set; stage {stage} takes optimizer steps of "
                        f"global_batch_size {unit} of data.train_file")
    elif dp and rc.micro_batch_size != "auto" and _in_domain(rc, "micro_batch_size", "global_batch_size") and \
            rc.global_batch_size % (rc.micro_batch_size * dp):
        problems.append(f"{where(trained + '.global_batch_size')}: {rc.global_batch_size} is not divisible by "
                        f"micro_batch_size*DP = {rc.micro_batch_size}*{dp} ({unit}); use a multiple of {rc.micro_batch_size * dp}")
    elif dp and rc.global_batch_size % dp:
        problems.append(f"{where(trained + '.global_batch_size')}: {rc.global_batch_size} is not divisible by DP = {dp}")
    if stage in ("rm", "prm") and config.reward.type != "model":
        problems.append(f"{where('reward.type')}: {config.reward.type}; stage {stage} trains a reward model: type: model")
    if stage in ("rm", "prm") and config.reward.normalize:
        problems.append(f"{where('reward.normalize')}: RL's normalisation of the reward model's scores; stage {stage} "
                        "does not read it (remove it here)")
    if stage == "prm" and config.data.apply_chat_template:
        problems.append(f"{where('data.apply_chat_template')}: stage prm reads text rows (a prompt and its steps, "
                        "TRL's stepwise format), encoded as text; set it false")
    if stage == "prm" and not config.prm.step_separator:
        problems.append(f"{where('prm.step_separator')}: empty; every step ends with it and its last token is scored")
    for role in config.roles:
        if config.has_own_layout(role) and role not in config.trainable_roles:
            problems.append(f"{where(role + '.parallel')}: the stages before RL run every role at the run's layout "
                            "(parallel.*); remove it")
    if stage == "dpo":
        ref, policy = config.reference, config.policy
        if ref.model.network() != policy.model.network():
            problems.append(f"{where('reference.model')}: DPO's reference is the policy's network (its starting "
                            "weights); give it the policy's architecture")
    return problems


def _untrained_role_keys(config: RLHFConfig) -> List[str]:
    """A trained role's key (TRAINED_ROLE_KEYS) set on a role the stage does not train, refused by
    name with the key that does what was meant, where one does."""
    problems = []
    for role in config.roles:
        if role in config.trainable_roles:
            continue
        trained = config.served_weights.get(role)
        for key in TRAINED_ROLE_KEYS:
            if f"{role}.{key}" in config.origin:
                hint = (f"set {trained}.{key} instead ({role} runs its weights)" if trained in config.trainable_roles
                        else f"remove it ({role} is frozen; trained: {', '.join(config.trainable_roles)})")
                problems.append(f"{config.at(role + '.' + key)}: stage {config.stage} does not train {role}, so "
                                f"{role}.{key} would do nothing; {hint}")
    return problems


def _log_prob_keys(config: RLHFConfig) -> List[str]:
    """logprob_chunk_tokens set on a role that computes no log-probs (a scalar head; the judge,
    which only generates), refused by name."""
    problems = []
    for role in config.roles:
        if f"{role}.logprob_chunk_tokens" in config.origin and (ROLE_HEADS[role] == "scalar" or role == "judge"):
            what = "has a scalar head" if ROLE_HEADS[role] == "scalar" else "only generates"
            problems.append(f"{config.at(role + '.logprob_chunk_tokens')}: {role} {what}, so no log-probs are computed "
                            "from its logits; remove it")
    return problems


def _unread_keys(config: RLHFConfig) -> List[str]:
    """Keys set that the run's stage does not read (RLHFConfig.unread_settings), each refused by
    name, never ignored."""
    unread, keys = config.unread_settings()
    problems = []
    for key in sorted(k for k in config.origin if k):
        head = key.split(".")[0]
        if head in unread or key in keys:
            what = "a role it does not build" if head in ROLE_NAMES else "a setting it does not read"
            problems.append(f"{config.at(key)}: stage {config.stage} runs {', '.join(config.roles)}; {key} is {what}: "
                            "remove it")
    return problems


# The checks across keys, in the order they report (layout_problems runs them once the networks are
# complete); each takes the config and the Layout.
CHECKS = (
    ("serving roles' own layouts", lambda config, layout: _role_layout_problems(config, layout.world_size)),
    ("networks", _network_problems),
    ("micro-batches by tokens", lambda config, layout: [p for role in config.model_roles
                                                       for p in _token_budget_problems(config, role)]),
    ("data, generation and batches", lambda config, layout: _run_problems(config, layout.dp)),
    ("routing replay", lambda config, layout: _routing_replay_problems(config)),
    ("multi-turn rollouts and tools", lambda config, layout: _rollout_problems(config)),
    ("partial rollouts and rollout correction", _partial_problems),
    ("LoRA", lambda config, layout: _lora_problems(config)),
    ("fixed device addresses", lambda config, layout: _fixed_address_problems(config)),
    ("batch-invariant arithmetic", lambda config, layout: _batch_invariant_problems(config)),
    ("context parallelism", lambda config, layout: _context_parallel_problems(config)),
    ("packed rows", lambda config, layout: _packed_rows_problems(config)),
    ("served weights", _served_weight_problems),
)


def _pointed_at(latest: str) -> str:
    """The checkpoint directory a run's ``latest`` pointer file names."""
    with open(latest, encoding="utf-8") as f:
        return os.path.join(os.path.dirname(latest), f.read().strip())


def not_a_model_checkpoint(path: str) -> str:
    """What ``path`` is, given where a model checkpoint (a directory with CHECKPOINT_META_FILE)
    was expected, and what to name instead."""
    meta = CHECKPOINT_META_FILE
    convert = "write one with tools/convert_hf_to_megatron.py"
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.normpath(path))
        return f"{path}: no such file or directory" + ("" if os.path.isdir(parent) else f" ({parent} does not exist either)")
    if os.path.basename(os.path.normpath(path)) == "latest" and os.path.isfile(path):
        return (f"{path} is a run's pointer to its newest checkpoint: name a trained role's directory in it, "
                f"{_pointed_at(path)}/<role>")
    if not os.path.isdir(path):
        return f"{path} is a file; a model checkpoint is a directory holding {meta} ({convert})"
    roles = sorted(d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, meta)))
    if roles:  # a run checkpoint's iteration folder (iter_N) or a converted set of roles
        return (f"{path} holds the model checkpoints of {', '.join(roles)} (a run checkpoint's iteration folder): name "
                f"one of them, e.g. {os.path.join(path, roles[0])}")
    latest = os.path.join(path, "checkpoints", "latest")
    if os.path.isfile(latest) or os.path.isfile(os.path.join(path, "latest")):
        pointer = latest if os.path.isfile(latest) else os.path.join(path, "latest")
        return (f"{path} is a run's output directory, not a model checkpoint: name a trained role's directory in "
                f"its latest checkpoint, {_pointed_at(pointer)}/<role>")
    if os.path.isfile(os.path.join(path, "config.json")):
        return f"{path} is a Hugging Face model directory (no {meta}); {convert}"
    return f"{path} is not a model checkpoint (no {meta}); {convert}"


def input_problems(config: RLHFConfig, needs_prompts: bool = False) -> List[str]:
    """Files the config names that are not on this machine: role checkpoints (``load``), the HF
    tokenizer, the prompt file (and, with ``needs_prompts``, a prompt file not set at all)."""
    problems: List[str] = []

    def missing(key: str, message: str) -> None:
        problems.append(f"{config.at(key)}: {message}")

    reported = set()  # a checkpoint two roles start from (DPO's reference takes the policy's) is named once
    for role in config.model_roles:
        load = config.path_of(role + ".load")
        if load is not None and load not in reported and not os.path.isfile(os.path.join(load, CHECKPOINT_META_FILE)):
            reported.add(load)
            missing(role + ".load", not_a_model_checkpoint(load))
    template = config.path_of("judge.template_file") if config.judge.enabled else None
    if template is not None and not os.path.isfile(template):
        missing("judge.template_file", f"{template}: no such file (the judge's prompt: text with {{prompt}}, "
                "{response}, {reference})")
    tokenizer = config.data.tokenizer
    if tokenizer.type == "hf":
        path = config.path_of("data.tokenizer.path")
        if not path:
            missing("data.tokenizer.path", "tokenizer type 'hf' needs a Hugging Face model directory or tokenizer.json")
        elif not os.path.exists(path):
            missing("data.tokenizer.path", f"{path}: no such file or directory (expected a Hugging Face model "
                    "directory with its tokenizer files, or a tokenizer.json)")
    if config.stage != "rl":  # a stage reads rows (data.train_file); RL prompts (data.prompt_file)
        if config.data.train_file is None and needs_prompts:
            missing("data.train_file", f"no training rows given; stage {config.stage} reads "
                    + ("chats ('messages') or 'prompt' and 'completion'" if config.stage == "sft"
                       else "preference pairs ('prompt', 'chosen', 'rejected')") + " from a JSONL or Parquet file")
        for key in ("data.train_file", "data.val_file"):
            path = config.path_of(key)
            if path is not None and not os.path.isfile(path):
                missing(key, f"{path}: no such file (expected JSONL or Parquet)")
        return problems
    if config.data.train_file is not None:
        missing("data.train_file", "set, but stage: rl reads prompts from data.prompt_file; train_file holds the rows "
                "of the stages before RL (stage: sft, rm or dpo)")
    prompt_file = config.path_of("data.prompt_file")
    if prompt_file is None and needs_prompts:
        missing("data.prompt_file", 'no prompt file given; name a JSONL file of {"prompt": ...} lines or a Parquet file')
    for key in ("data.prompt_file", "data.val_file"):
        path = config.path_of(key)
        if path is not None and not os.path.isfile(path):
            missing(key, f"{path}: no such file (expected JSONL, one {{\"prompt\": ...}} per line, or Parquet)")
    return problems


def validate(config: RLHFConfig, world_size: Optional[int] = None, check_inputs: bool = True) -> None:
    """Raise ConfigError listing every problem of the layout (and, with ``check_inputs``, of the
    files the config names): all of them, not just the first."""
    problems = layout_problems(config, world_size) + (input_problems(config) if check_inputs else [])
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
