"""The dry run of ``megatron_rlhf.train --dry-run``: what a launch would do, without a process group,
a GPU or a model. It prints the resolved config, the parallel layout (process groups, and per role
the network, batch sizes and EMS switches) and each role's memory by kind from the planner, so a
70B plan can be checked on a laptop. Files the config names that are missing here are listed, not
fatal: the checkpoints usually live only on the cluster."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from megatron_rlhf.config import input_problems, load_config, validate
from megatron_rlhf.config.presets import AUTO
from megatron_rlhf.config.schema import ROLE_HEADS, ROLE_NAMES, RLHFConfig, stage_layers
from megatron_rlhf.config.validation import weight_sharing_notes
from megatron_rlhf.memory.kinds import OPTIMIZER_STATE, WEIGHTS, EMSSwitches
from megatron_rlhf.memory.planner import (KINDS, TRANSIENT, CheckpointPlan, Plan, checkpoint_plan, expert_numels,
                                          micro_batches_per_step, param_numels, plan, recommend)
from megatron_rlhf.units import human

def host_text(p: Plan, nproc_per_node: int) -> str:
    roles = ", ".join(f"{r} {human(b)}" for r, b in p.host.items() if b) or "none"
    return (f"host memory (EMS arenas, exact): {human(p.host_bytes)} per rank ({roles}); "
            f"{human(p.host_bytes * nproc_per_node)} per node of {nproc_per_node} ranks")


def checkpoint_text(c: CheckpointPlan) -> str:
    roles = ", ".join(f"{r}: weights {human(k[WEIGHTS])} + optimizer state {human(k[OPTIMIZER_STATE])}"
                      for r, k in c.writer.items())
    held = ("every role's copy in host memory until the background writer is done" if c.background
            else "one role at a time in host memory")
    return (f"checkpoint save (every rank writes its own part of the optimizer state, DP rank 0 of each model-parallel "
            f"slice also the slice's weights; nothing gathered): {human(c.other_bytes)} per rank, {human(c.writer_bytes)} "
            f"on DP rank 0 ({roles}), {held} (peak {human(c.writer_peak)}); "
            f"{human(c.node_bytes)} on the busiest node of {c.nproc_per_node} ranks ({c.writers_per_node} DP rank 0)")


def format_plan(p: Plan) -> str:
    cols = KINDS[:-1] + TRANSIENT
    experts = f" EP={p.layout['ep']}" if p.layout["ep"] > 1 else ""
    context = f" CP={p.layout['cp']}" if p.layout["cp"] > 1 else ""
    lines = [f"layout: TP={p.layout['tp']} PP={p.layout['pp']}{context} DP={p.layout['dp']}{experts}, sequence {p.layout['seq']} tokens; "
             "per GPU, most loaded pipeline stage"]
    lines.append(f"{'role':<11}" + "".join(f"{c:>17}" for c in cols))
    for role, kinds in p.roles.items():
        row = {**kinds, **p.transient[role]}
        lines.append(f"{role:<11}" + "".join(f"{human(row.get(c, 0)):>17}" for c in cols))
    lines.append("")
    lines.append("phase          resident on the device")
    for phase, total in p.phases.items():
        mark = "  <- peak" if phase == p.peak_phase else ""
        lines.append(f"{phase:<14} {human(total):>12}{mark}")
    return "\n".join(lines)


def load_for_planning(config_file: str, world_size: Optional[int] = None,
                      overrides: Sequence[str] = ()) -> Tuple[RLHFConfig, int]:
    """The config (``overrides``: key=value over it) validated for ``world_size`` (default: TP*PP*CP),
    and that world size. The files it names are not checked: planning needs none of them."""
    config = load_config(config_file, check_inputs=False, overrides=overrides)
    par = config.parallel
    world_size = world_size or par.replica_ranks()
    validate(config, world_size, check_inputs=False)
    return config, world_size


def memory_report(config, world_size: int, gpu_memory: Optional[int] = None,
                  seq_length: Optional[int] = None, nproc_per_node: Optional[int] = None) -> Tuple[str, bool]:
    """The per-role table and the phases with the configured EMS switches, the host memory, and
    with ``gpu_memory`` the least offloading that fits. Returns (text, whether it fits: True
    without a budget). generation.batch_size: auto is planned at what ``gpu_memory`` holds, as
    start-up would choose it (decode_slots_planned)."""
    choice, config = decode_slots_planned(config, world_size, gpu_memory)
    configured = plan(config, world_size, seq_length=seq_length)
    lines = ["with the configured EMS switches:", format_plan(configured),
             host_text(configured, nproc_per_node or world_size)]
    if config.trainer.save_interval or config.trainer.save_at_end:
        lines.append(checkpoint_text(checkpoint_plan(config, world_size, nproc_per_node)))
    lines.append(choice)
    if not gpu_memory:
        return "\n".join(lines), True
    switches, fitted = recommend(config, world_size, gpu_memory, seq_length)
    lines.append("")
    if switches is None:
        lines.append(f"does not fit in {human(gpu_memory)}: even with every role offloaded the peak is "
                     f"{human(fitted.peak_bytes)} ({fitted.peak_phase}), {human(fitted.peak_bytes - gpu_memory)} over; "
                     "raise TP/PP, enable recompute_activations or lower micro-batch and sequence sizes")
        return "\n".join(lines), False
    on = [f"{role}: {', '.join(s.kinds())}" for role, s in switches.items() if s.kinds()]
    lines.append(f"fits in {human(gpu_memory)} with peak {human(fitted.peak_bytes)} ({fitted.peak_phase}) "
                 f"when these leave the device while idle: {'; '.join(on) if on else 'nothing'}")
    return "\n".join(lines), True


def decode_slots_planned(config, world_size: int, gpu_memory: Optional[int]) -> Tuple[str, RLHFConfig]:
    """The rows the engine decodes at once per DP rank, said, and the config to plan with: as
    configured, or (batch_size: auto) the rows ``gpu_memory`` holds with the configured switches
    (memory/auto.decode_slots, as start-up chooses them) in a copy of ``config``."""
    import copy
    import dataclasses

    from megatron_rlhf.memory.auto import decode_slots, no_row_fits

    if config.stage != "rl":
        return "generation: none (stage " + config.stage + ")", config
    batch = config.generation.batch_size
    if batch != "auto":
        return (f"generation: {'every row of the rollout' if batch is None else f'{batch} rows'} decoded at once per DP "
                "rank"), config
    if not gpu_memory:
        return ("generation.batch_size: auto: chosen at start-up from the free device memory (planned here at every "
                "row of the rollout; give --gpu-memory to see the choice)"), config
    slots, rows, fitted = decode_slots(config, world_size, gpu_memory)
    if not slots:
        return f"generation.batch_size: auto: {no_row_fits(fitted, gpu_memory)} (a run would stop)", config
    chosen = copy.copy(config)
    chosen.generation = dataclasses.replace(config.generation, batch_size=slots)
    return (f"generation.batch_size: auto: in {human(gpu_memory)}, {slots} of {rows} rows decoded at once per DP rank "
            f"(KV cache {human(fitted.transient['policy']['kv_cache'])}, peak {human(fitted.peak_bytes)} in "
            f"{fitted.peak_phase})"), chosen


def rank_groups(tp: int, pp: int, dp: int, ep: int = 1, cp: int = 1) -> Dict[str, List[List[int]]]:
    """Global ranks of each TP, CP, DP and PP group and, with experts split (``ep`` > 1), each expert-
    parallel ("ep") and expert-data-parallel ("edp") group, as megatron-core numbers them (its
    RankGenerator, orders tp-cp-ep-dp-pp and, for experts with ETP = TP, tp-ep-dp-pp): rank = tp_rank
    + TP * (cp_rank + CP * (dp_rank + DP * pp_rank)), and dp_rank = ep_rank + EP * edp_rank. Computed here, without
    importing megatron (torch: 2.6 s of a dry run); tests/test_docs.py checks it against
    RankGenerator for several layouts."""
    groups = {kind: _orthogonal_groups([tp, cp, dp, pp], i) for i, kind in enumerate(("tp", "cp", "dp", "pp"))}
    if ep > 1:
        sizes = [tp, cp, ep, dp // ep, pp]
        groups.update(ep=_orthogonal_groups(sizes, 2), edp=_orthogonal_groups(sizes, 3))
    return groups


def _orthogonal_groups(sizes: List[int], varying: int) -> List[List[int]]:
    """The groups whose members differ in dimension ``varying`` alone of a rank numbered with the
    first dimension fastest (rank = sum of index x the product of the sizes before it); groups in
    the order of the other dimensions' indices, the first fastest (megatron's order)."""
    strides = [1]
    for size in sizes[:-1]:
        strides.append(strides[-1] * size)
    others = [d for d in range(len(sizes)) if d != varying]
    groups = []
    for group in range(math.prod(sizes) // sizes[varying]):
        base, rest = 0, group
        for d in others:
            base, rest = base + (rest % sizes[d]) * strides[d], rest // sizes[d]
        groups.append([base + i * strides[varying] for i in range(sizes[varying])])
    return groups


def resolved_config_text(config: RLHFConfig) -> str:
    tree = config.settings()
    for role in set(ROLE_NAMES) - set(config.roles):  # the algorithm does not run them
        tree.pop(role)
    sections, keys = config.unread_settings()
    for section in sections:  # what the run's stage does not read (validation refuses them set)
        tree.pop(section, None)
    for key in keys:
        section, name = key.split(".")
        tree[section].pop(name)
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=False).rstrip()


def _work_line(config: RLHFConfig) -> str:
    """What the run does: RL's algorithm and rollout, or a stage's steps."""
    if config.stage != "rl":  # a stage's work is optimizer steps over rows; RL's an algorithm over prompts
        trained = config.trainable_roles[0]
        unit = config.sample_unit
        return (f"stage: {config.stage}, roles: {', '.join(config.roles)} ({trained} trained); optimizer steps of "
                f"{config.role(trained).global_batch_size} {unit} of data.train_file, {config.stage_config.epochs} epoch(s)")
    return (f"algorithm: {config.algorithm.advantage_estimator}, roles: {', '.join(config.roles)}"
            + (" (no critic)" if config.critic_free else "")
            + f"; {config.ppo.rollout_batch_size} prompts x {config.generation.samples_per_prompt} responses per iteration")


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _span(ranks: List[int]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ",".join(map(str, ranks))


def _own_layout_text(config: RLHFConfig, role: str, world_size: int) -> str:
    """A serving role's own layout: its sizes, first groups, and where its weights come from."""
    own = config.layout_of(role)
    tp, pp, ep = own.tensor_model_parallel_size, own.pipeline_model_parallel_size, own.expert_model_parallel_size
    ep = ep if config.role(role).model.num_experts else 1
    dp = world_size // own.replica_ranks()
    groups = rank_groups(tp, pp, dp, ep, own.context_parallel_size)
    experts = (f"; EP={ep}, expert-parallel groups first {_span(groups['ep'][0])}, expert-data-parallel first "
               f"{_span(groups['edp'][0])}" if ep > 1 else "")
    served = config.served_weights.get(role)
    source = (f"served from {served} by megatron-core's resharding after every training phase" if served
              else f"loaded from {role}.load")
    return (f"{'':<11}own layout: TP={tp} PP={pp} DP={dp}; tensor-parallel groups first {_span(groups['tp'][0])}, "
            f"data-parallel first {_span(groups['dp'][0])}, pipeline stages " +
            "; ".join(f"{s}: {_span(sorted(g[s] for g in groups['pp']))}" for s in range(pp)) + experts + f"; weights {source}")


ATTENTION_KINDS = {"fused": "fused (torch scaled_dot_product_attention, no s x s scores)",
                   "local": "local (megatron's, an s x s mask and scores per layer)"}


def attention_text(config: RLHFConfig) -> str:
    """Which core attention each model role runs (models/attention.py)."""
    by_kind: Dict[str, List[str]] = {}
    for role in config.model_roles:
        by_kind.setdefault(config.role(role).attention, []).append(role)
    kinds = "; ".join(f"{ATTENTION_KINDS[kind]}: {', '.join(roles)}" for kind, roles in by_kind.items())
    return f"attention: {kinds} (transformer-engine's own where it is installed)"


def _group_lines(groups: Dict[str, List[List[int]]], tp_in_node: bool) -> List[str]:
    """The layout's process groups (rank_groups), one line per kind."""
    tp, dp, pp = len(groups["tp"][0]), len(groups["dp"][0]), len(groups["pp"][0])
    cp, ep = len(groups["cp"][0]), len(groups["ep"][0]) if "ep" in groups else 1
    return [
        f"  tensor-parallel groups: {len(groups['tp'])} of {tp} ranks ({'each within one node' if tp_in_node else 'SPANNING NODES: TP all-reduces cross the network; keep TP <= GPUs per node'}), "
        f"first {_span(groups['tp'][0])}",
        *([f"  context-parallel groups (each row's positions divided over them): {len(groups['cp'])} of {cp} ranks, "
           f"first {_span(groups['cp'][0])}"] if cp > 1 else []),
        f"  data-parallel groups: {len(groups['dp'])} of {dp} ranks, first {_span(groups['dp'][0])}",
        *([f"  expert-parallel groups: {len(groups['ep'])} of {ep} ranks (each layer's experts split over them), "
           f"first {_span(groups['ep'][0])}; expert-data-parallel groups (the experts' gradients and distributed "
           f"optimizer): {len(groups['edp'])} of {dp // ep} ranks, first {_span(groups['edp'][0])}"] if ep > 1 else []),
        "  pipeline stages: " + "; ".join(f"{s}: ranks {_span(sorted(g[s] for g in groups['pp']))}" for s in range(pp)),
    ]


def layout_text(config: RLHFConfig, world_size: int, nproc_per_node: int) -> str:
    par = config.parallel
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    dp = world_size // par.replica_ranks()
    nodes = -(-world_size // nproc_per_node)
    ep = par.expert_model_parallel_size
    groups = rank_groups(tp, pp, dp, ep, cp)
    # torchrun numbers ranks node by node.
    tp_in_node = all(len({r // nproc_per_node for r in g}) == 1 for g in groups["tp"])
    lines = [
        f"{world_size} processes = {nodes} node(s) x {nproc_per_node}; TP={tp} PP={pp}{f' CP={cp}' if cp > 1 else ''} DP={dp}"
        f"{f' EP={ep}' if ep > 1 else ''} for "
        f"{'the roles without a layout of their own' if any(config.has_own_layout(r) for r in config.model_roles) else 'every role'} "
        f"(sequence parallel {'on' if par.sequence_parallel else 'off'})",
        _work_line(config),
        *_group_lines(groups, tp_in_node),
        "",
        f"{'role':<11}{'network':<14}{'params':>9}  {'head':<8}{'dtype':<6}{'layers/stage':>13}{'micro':>7}"
        f"{'global':>8}{'accum':>7}  {'optimizer':<11}{'leaves the device when idle'}",
    ]
    for role in config.model_roles:
        rc = config.role(role)
        arch = rc.model
        experts = sum(expert_numels(arch, 1, 1, 0, 1))
        params = sum(param_numels(arch, ROLE_HEADS[role], 1, 1, 0)) + experts
        network = arch.preset if arch.preset not in (None, AUTO) else f"{arch.family}-h{arch.hidden_size}x{arch.num_layers}"
        if role in config.trainable_roles:
            global_batch, accum = str(config.samples_per_step(role)), str(micro_batches_per_step(config, role, dp))
            optimizer = "Adam, dist" if rc.use_distributed_optimizer else "Adam"
        else:
            global_batch = accum = optimizer = "-"
        kinds = [k for k in EMSSwitches.from_role_config(rc, auto=False).kinds() if role in config.trainable_roles or k == "weights"]
        owner = config.weight_owner(role)
        if rc.free_memory == "auto":
            kinds = ["auto (chosen at start-up from the free device memory)"]
        elif owner:
            kinds = [k for k in kinds if k != "weights"] + [f"(weights are {owner}'s)"]
        lines.append(
            f"{role:<11}{network:<14}{_count(params):>9}  {ROLE_HEADS[role]:<8}{rc.precision:<6}"
            f"{len(stage_layers(arch.num_layers, config.layout_of(role).pipeline_model_parallel_size, 0)):>13}{str(rc.micro_batch_size):>7}{global_batch:>8}{accum:>7}  {optimizer:<11}"
            f"{', '.join(kinds) or 'nothing'}"
        )
        if config.has_own_layout(role):
            lines.append(_own_layout_text(config, role, world_size))
        if arch.num_experts:
            active = params - experts + experts * arch.moe_router_topk // arch.num_experts
            lines.append(f"{'':<11}experts: {arch.num_experts} in each of {sum(arch.moe_layers())} layers, top-"
                         f"{arch.moe_router_topk} per token ({_count(active)} parameters active), "
                         f"{arch.num_experts // config.layout_of(role).expert_model_parallel_size} per EP rank")
        if rc.load:
            lines.append(f"{'':<11}load: {config.path_of(role + '.load')}")
    lines.append(attention_text(config))
    if config.reward.type == "function":
        named = config.reward.functions or {config.reward.function: 1.0}
        shown = ", ".join(spec if len(named) == 1 else f"{weight:g} x {spec}" for spec, weight in named.items())
        lines.append(f"{'reward':<11}rule function {shown} (no network; {config.reward.num_workers} worker processes "
                     f"per model-parallel group, {config.reward.timeout_s:g}s per call)")
    if config.reward.step_separator is not None and config.stage == "rl":
        how = ("each step's score a reward at its last token" if config.reward.step_aggregation == "token"
               else f"the {config.reward.step_aggregation} of the step scores")
        lines.append(f"{'reward':<11}process reward model: steps end at {config.reward.step_separator!r} and at the "
                     f"response's end, each scored sigmoid(its last token's score); {how}")
    if "judge" in config.roles:
        judge = config.judge
        read = {"choice": f"choices {judge.choices}", "function": f"{judge.parser_function}, in the reward pool's "
                f"workers"}.get(judge.parser, f"in [{judge.score_range[0]:g}, {judge.score_range[1]:g}]")
        how = "1 greedy verdict" if judge.samples == 1 else \
            f"{judge.samples} verdicts sampled at temperature {judge.temperature:g}, their {judge.combine}"
        lines.append(f"{'judge':<11}{how} per response, up to {judge.max_new_tokens} tokens after a prompt of up to "
                     f"{judge.max_prompt_length}; parser {judge.parser} ({read}), unparsed {judge.unparsed_score:g}; "
                     f"{judge.weight:g} x its score added to the reward")
    lines.extend(f"note: {n}" for n in weight_sharing_notes(config))
    return "\n".join(lines)


def dry_run(config_file: str, world_size: Optional[int] = None, nproc_per_node: Optional[int] = None,
            gpu_memory: Optional[int] = None, seq_length: Optional[int] = None, memory_only: bool = False,
            overrides: Sequence[str] = ()) -> int:
    """Print the plan of a launch on ``world_size`` processes (default: TP*PP*CP): the resolved config,
    the layout and the memory per role (``memory_only``: the memory alone). Returns 0, or 1 when
    ``gpu_memory`` is given and the run cannot fit. Raises ConfigError for a config or layout the
    run would refuse."""
    config, world_size = load_for_planning(config_file, world_size, overrides)
    text, fits = memory_report(config, world_size, gpu_memory, seq_length, nproc_per_node)
    if memory_only:
        print(text)
        return 0 if fits else 1
    print(f"# resolved config ({config_file}, environment applied)")
    print(resolved_config_text(config))
    print("\n# parallel layout")
    print(layout_text(config, world_size, nproc_per_node or world_size))
    print("\n# device memory per GPU, by role and kind (planner: state exact, activations, KV cache and decode step estimated)")
    print(text)
    missing = input_problems(config, needs_prompts=True)
    if missing:
        print("\n# not found on this machine (a real launch stops on these)")
        print("\n".join(f"  {m}" for m in missing))
    print("\ndry run: nothing was launched")
    return 0 if fits else 1
