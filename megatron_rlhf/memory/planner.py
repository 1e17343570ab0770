"""The memory planner: each role's device memory by kind and by phase, from the config alone.

State bytes (weights, grads, main params, optimizer state) are exact: they count the same tensors
megatron allocates, including the distributed optimizer's buffer padding, for the most loaded
pipeline stage. The KV cache is exact too: the generation engine allocates slots x
(max_prompt_length + max_new_tokens) positions per layer of the stage. Activations are estimates
(formulas below); a trainable role under
pipeline parallelism holds up to PP micro-batches of activations (1F1B's warm-up on the first stage).

A PPO iteration has six phases (four without a critic; one more with a judge, which generates like
the policy: its KV cache holds judge.max_prompt_length + judge.max_new_tokens positions); in each, the active role holds what the phase needs and every
other role holds what its EMS switches keep resident. The peak phase bounds the device memory
the run needs (plus the framework's own overhead, which is not modelled). Host memory is exact:
each role's EMS arenas hold exactly the kinds its switches copy, and all stay allocated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from megatron_rlhf.config.schema import (EMS_SWITCHES, GENERATING_ROLES, ROLE_HEADS, ModelArchConfig, RLHFConfig,
                                         RoleConfig, stage_layers)
from megatron_rlhf.memory.kinds import GRADS, LEDGER_KINDS as KINDS, MAIN_PARAMS, OPTIMIZER_STATE, PHASE_NEEDS, WEIGHTS, EMSSwitches

TRANSIENT = ("activations", "kv_cache", "decode_step", "reshard_buffers")
BYTES = {"fp32": 4, "bf16": 2}


def _phases(config: RLHFConfig) -> Tuple[Tuple[str, str, Tuple[str, ...]], ...]:
    """(phase, active role, what it needs besides its state) of the run's phases, in order."""
    return tuple((phase, role, ("kv_cache", "decode_step") if role in GENERATING_ROLES else ("activations",))
                 for phase, role in config.phase_order)


def _stage_layers(arch: ModelArchConfig, pp: int, pp_rank: int) -> List[int]:
    """Per layer of the stage: 1 where it has experts, 0 where its MLP is dense."""
    pattern = arch.moe_layers() if arch.num_experts else [0] * arch.num_layers
    return [pattern[layer] for layer in stage_layers(arch.num_layers, pp, pp_rank)]


def param_numels(arch: ModelArchConfig, head: str, tp: int, pp: int, pp_rank: int,
                 padded_vocab: Optional[int] = None) -> List[int]:
    """Element counts of this rank's parameters outside the experts (those megatron DDP reduces
    over DP), in module order (megatron local layers). A tied LM head has no weight of its own,
    except the last stage's copy under PP. A layer with experts has its router here instead of the
    dense MLP, and its shared expert (its routed experts: ``expert_numels``). ``padded_vocab``: the
    output rows (RLHFConfig.padded_vocab; default: padded for ``tp``)."""
    h, hd = arch.hidden_size, arch.kv_channels
    vocab = (padded_vocab or arch.padded_vocab_size(tp)) // tp
    qkv = (arch.num_attention_heads + 2 * arch.kv_groups) * hd // tp
    out: List[int] = []
    if pp_rank == 0:
        out.append(vocab * h)
    attention = [h, h * arch.num_attention_heads * hd // tp, qkv * h]  # input norm, attention output, fused QKV
    attention += [qkv] if arch.qkv_bias else []
    attention += [hd, hd] if arch.qk_norm else []
    dense_mlp = [2 * arch.ffn_hidden_size // tp * h, h * arch.ffn_hidden_size // tp]  # [gate; up], down
    moe = [arch.num_experts * h] if arch.num_experts else []  # the router
    shared = arch.moe_shared_expert_ffn_hidden_size
    if shared:  # its sigmoid gate, [gate; up], down
        moe += [h, 2 * shared // tp * h, h * shared // tp]
    for experts in _stage_layers(arch, pp, pp_rank):
        out += attention + [h] + (moe if experts else dense_mlp)  # pre-MLP norm, then experts' or MLP
    if pp_rank == pp - 1:
        out.append(h)  # final norm
        if not (arch.tied_output(head) and pp == 1):
            out.append((vocab if head == "lm" else 1) * h)  # output layer or scalar head
    return out


def expert_numels(arch: ModelArchConfig, tp: int, pp: int, pp_rank: int, ep: int) -> List[int]:
    """Element counts of this rank's experts (num_experts / EP per layer with experts, each split
    over TP like a dense MLP), in module order: megatron DDP keeps them in a buffer of their own,
    reduced over the expert-data-parallel group (DP / EP ranks)."""
    if not arch.num_experts:
        return []
    h, width = arch.hidden_size, arch.moe_ffn_hidden_size // tp
    local = [2 * width * h, h * width] * (arch.num_experts // ep)  # each expert's [gate; up], down
    return local * sum(_stage_layers(arch, pp, pp_rank))


def lora_numels(arch: ModelArchConfig, lora, tp: int, pp: int, pp_rank: int) -> List[int]:
    """Element counts of this rank's LoRA adapters (models/lora.py), in module order: per layer of
    the stage, each target's A then B (linear_proj, linear_qkv, linear_fc1, linear_fc2, megatron's
    order); a column-parallel linear's B and a row-parallel one's A are this rank's slice."""
    h, hd, r = arch.hidden_size, arch.kv_channels, lora.rank
    qkv = (arch.num_attention_heads + 2 * arch.kv_groups) * hd // tp
    ffn = arch.ffn_hidden_size // tp
    adapters = {"linear_proj": [r * arch.num_attention_heads * hd // tp, h * r], "linear_qkv": [3 * r * h, qkv * r],
                "linear_fc1": [2 * r * h, 2 * ffn * r], "linear_fc2": [r * ffn, h * r]}  # an A per projection
    layer = [n for target in ("linear_proj", "linear_qkv", "linear_fc1", "linear_fc2")
             if target in lora.target_modules for n in adapters[target]]
    return layer * len(_stage_layers(arch, pp, pp_rank))


def _buffer_ranges(numels: List[int]) -> List[Tuple[int, int]]:
    """[start, end) of each parameter in megatron DDP's contiguous buffer under the distributed
    optimizer (one bucket): filled in reverse module order, every parameter 64-aligned."""
    ranges, end = [], 0
    for n in reversed(numels):
        start = math.ceil(end / 64) * 64
        end = start + n
        ranges.append((start, end))
    return ranges


def _ddp_buffer_numel(numels: List[int], dp: int, distributed_optimizer: bool) -> int:
    """Elements of megatron DDP's contiguous buffer: with the distributed optimizer the end of the
    aligned parameters is padded to lcm(DP, 128)."""
    if not distributed_optimizer:
        return sum(numels)
    divisor = math.lcm(dp, 128)
    return math.ceil(_buffer_ranges(numels)[-1][1] / divisor) * divisor


def state_bytes(rc: RoleConfig, head: str, trainable: bool, tp: int, pp: int, dp: int, pp_rank: int,
                dp_rank: int = 0, ep: int = 1, edp_rank: int = 0, padded_vocab: Optional[int] = None,
                lora=None) -> Dict[str, int]:
    """Device bytes of each kind of one role's state on the rank (pp_rank, dp_rank; with experts
    split over ``ep`` ranks, its expert-data-parallel rank ``edp_rank``). ``lora``: the adapters the
    role's network carries (RLHFConfig.lora_of): then only they (and a value model's score head)
    are trained, the base frozen beside DDP's buffer."""
    arch = rc.model
    # Each group of parameters megatron DDP buffers apart, with the data-parallel group that
    # reduces (and with the distributed optimizer shards) it: dense over DP, experts over DP / EP.
    groups = [(param_numels(arch, head, tp, pp, pp_rank, padded_vocab), dp, dp_rank)]
    experts = expert_numels(arch, tp, pp, pp_rank, ep)
    if experts:
        groups.append((experts, dp // ep, edp_rank))
    width = BYTES[rc.precision]
    out = dict.fromkeys(KINDS, 0)
    if lora is not None and lora.enabled:
        frozen = sum(sum(numels) for numels, _, _ in groups)
        adapters = lora_numels(arch, lora, tp, pp, pp_rank)
        if head == "scalar" and pp_rank == pp - 1:  # the score head trains in full
            adapters, frozen = adapters + [arch.hidden_size], frozen - arch.hidden_size
        out[WEIGHTS] = frozen * width
        groups = [(adapters, dp, dp_rank)]
        if not trainable:
            out[WEIGHTS] += sum(adapters) * width
            return out
    # OTHER (module buffers) stays 0: the model registers none; megatron keeps the rotary
    # frequencies (head_dim / 2 floats) as a plain attribute.
    if not trainable:
        out[WEIGHTS] = sum(sum(numels) for numels, _, _ in groups) * width
        return out
    dist_opt = rc.use_distributed_optimizer
    for numels, group, rank in groups:  # the trained parameters
        buffer = _ddp_buffer_numel(numels, group, dist_opt)
        out[WEIGHTS] += (buffer if dist_opt else sum(numels)) * width
        out[GRADS] += buffer * 4  # grads reduced in fp32
        # What this rank's optimizer owns: its 1/group slice of the buffer (parameters only).
        owned = _owned_elements(numels, buffer, group, rank) if dist_opt else numels
        if rc.precision == "bf16":
            out[MAIN_PARAMS] += sum(owned) * 4
        # Adam: exp_avg and exp_avg_sq in fp32, and torch's per-parameter step (a 4-byte tensor).
        out[OPTIMIZER_STATE] += sum(owned) * 8 + 4 * sum(1 for n in owned if n)
    return out


def _owned_elements(numels: List[int], buffer: int, dp: int, dp_rank: int = 0) -> List[int]:
    """Per parameter, how many of its elements fall in DP rank ``dp_rank``'s shard of the buffer."""
    shard = buffer // dp
    lo, hi = dp_rank * shard, (dp_rank + 1) * shard
    return [max(0, min(end, hi) - max(start, lo)) for start, end in _buffer_ranges(numels)]


def activation_bytes(arch: ModelArchConfig, head: str, micro_batch: int, seq: int, tp: int, pp: int,
                     precision: str, recompute: bool, training: bool, padded_vocab: Optional[int] = None,
                     attention: str = "fused", logprob_chunk_tokens: int = 0, cp: int = 1) -> int:
    """Estimate of the activations one micro-batch keeps on a stage, counted as autograd keeps them
    per token of a layer (after Korthikanti et al. 2022, for a SwiGLU MLP and grouped-query heads,
    no sequence parallelism, no dropout): the two norms' inputs and outputs 4h; the query, key and
    value projection, their rotated copies, the attention's output and the projection's input
    4q + 3kv (q = heads x head dim, kv = groups x head dim); the MLP's gate and up projection, its
    activation and product 4f; the attention's own (fused: the kernel's contiguous q, k, v and its
    fp32 log-sum-exp per head, a sliding window's s x s booleans; local: the scores and
    probabilities a s per token (the softmax keeps its output) and, with groups, the keys and values repeated per head);
    all but the norms split over TP. Then the fp32 logits (LOGIT_COPIES of them): of every token,
    or of ``logprob_chunk_tokens`` tokens where an LM head's log-probs are computed in chunks. With
    full recomputation only each layer's input is kept. A forward-only pass keeps about one layer's
    worth at a time. Under context parallelism (``cp``) a rank holds seq / cp of each row's tokens
    and, per layer, the keys and values of the whole sequence gathered for its attention."""
    width = BYTES[precision]
    s, b, h, a = -(-seq // cp), micro_batch, arch.hidden_size, arch.num_attention_heads
    q, kv, f = a * arch.kv_channels, arch.kv_groups * arch.kv_channels, arch.ffn_hidden_size
    if attention == "local":
        own = a * s * width + (2 * q * width if kv != q else 0)
    else:
        own = (q + 2 * kv) * width + a * 4 + (s if arch.sliding_window else 0)
    per_layer = s * b * (4 * h * width + ((4 * q + 3 * kv + 4 * f) * width + own) / tp)
    if cp > 1:  # the CP group's keys and values, gathered (models/context_parallel.py)
        per_layer += seq * b * 2 * kv * width / tp
    layers = len(stage_layers(arch.num_layers, pp, 0))
    if arch.num_experts:  # the most loaded stage: its layers with experts
        moe_layers = max(sum(_stage_layers(arch, pp, r)) for r in range(pp))
        per_layer += moe_layers / layers * _expert_activations_extra(arch, s * b, tp, width)
    kept = (s * b * h * width * layers if recompute else per_layer * layers) if training else per_layer
    if head != "lm":
        return int(kept + s * b * 4 * (2 if training else 1))  # a scalar head's fp32 values (and their gradient)
    chunked = bool(logprob_chunk_tokens)
    rows = min(logprob_chunk_tokens, s * b) if chunked else s * b
    vocab = (padded_vocab or arch.padded_vocab_size(tp)) // tp
    return int(kept + rows * vocab * 4 * LOGIT_COPIES[chunked, training])


# The fp32 [rows, vocabulary/TP] tensors a log-prob pass holds at once (bench/chunked_log_probs.py
# measured them): whole logits, their copy divided by the temperature (megatron's cross entropy
# then works in place), and in training the entropy's shifted copy and exponentials, the softmax
# kept for backward and its gradient; a chunk's in place where it can (models/vocab_parallel.py).
LOGIT_COPIES = {(False, False): 2, (False, True): 5, (True, False): 2, (True, True): 4}


def _expert_activations_extra(arch: ModelArchConfig, tokens: int, tp: int, width: int) -> float:
    """What a layer with experts keeps beyond the dense estimate's MLP part (16 sbh/TP for an MLP of
    4h): each token's top-k copies dispatched to experts of moe_ffn_hidden_size, in and out of them,
    with the same per-width cost; assuming balanced routing (an estimate, as the rest)."""
    h, k = arch.hidden_size, arch.moe_router_topk
    dense_mlp = tokens * h * 16 / tp * width / 2
    experts = tokens * h * 16 / tp * (k * arch.moe_ffn_hidden_size / (4 * h)) * width / 2
    dispatched = 2 * k * tokens * h * width  # the permuted tokens and the experts' outputs
    return experts + dispatched - dense_mlp


def decode_step_bytes(arch: ModelArchConfig, rows: int, seq: int, tp: int, pp: int, precision: str,
                      padded_vocab: Optional[int] = None) -> int:
    """The working memory of one decode step of ``rows`` slots: a forward of one token per row (one
    layer's activations at a time, attention scores over up to ``seq`` cached positions per head),
    then sampling over the fp32 logits (the forward's logits and their copy divided by the
    temperature, their probabilities, the sorted probabilities with their int64 indices, the
    log-probs). On CUDA the step is captured, and this is what the graphs' memory pool holds for
    the whole engine call (generation/decode.py)."""
    forward = activation_bytes(arch, "lm", rows, 1, tp, pp, precision, False, False, padded_vocab)
    scores = rows * seq * (arch.num_attention_heads // tp) * 4
    vocab = (padded_vocab or arch.padded_vocab_size(tp)) // tp
    return int(forward + scores + rows * vocab * (4 + 12 + 4))


def kv_cache_bytes(arch: ModelArchConfig, batch: int, seq: int, tp: int, pp: int, precision: str) -> int:
    """Keys and values of every layer on the stage for ``batch`` sequences of ``seq`` tokens."""
    hd = arch.kv_channels
    return 2 * len(stage_layers(arch.num_layers, pp, 0)) * batch * seq * (arch.kv_groups // tp) * hd * BYTES[precision]


def reshard_buffer_bytes(config: RLHFConfig, serving: str, world_size: int) -> int:
    """The buffers megatron's resharding allocates on the most loaded rank while it serves ``serving``
    (a role of its own layout) its trained role's weights: a receive buffer for every slice of the
    serving shard, and where the serving TP is larger than the trained one, a contiguous copy of each
    sent slice of the row-parallel weights (attention output and MLP down projections, cut along
    their inputs; of the dense layers only). 0 for a role served without resharding."""
    trained = config.served_weights.get(serving)
    if trained is None or not config.has_own_layout(serving):
        return 0
    rc, arch = config.role(serving), config.role(serving).model
    own, run = config.layout_of(serving), config.parallel
    stp, spp = own.tensor_model_parallel_size, own.pipeline_model_parallel_size
    received = max(state_bytes(rc, ROLE_HEADS[serving], False, stp, spp, world_size // (stp * spp), r,
                               ep=own.expert_model_parallel_size, padded_vocab=config.padded_vocab(arch))[WEIGHTS]
                   for r in range(spp))  # the serving shard's weights, each element received once
    copied = 0
    ttp, tpp = run.tensor_model_parallel_size, run.pipeline_model_parallel_size
    if stp > ttp and not arch.num_experts:
        h, hd = arch.hidden_size, arch.kv_channels
        row_parallel = h * arch.num_attention_heads * hd // ttp + h * arch.ffn_hidden_size // ttp
        copied = len(stage_layers(arch.num_layers, tpp, 0)) * row_parallel * BYTES[config.role(trained).precision]
    return received + copied


def micro_batch_rows(config: RLHFConfig, role: str) -> int:
    """Rows of a role's micro-batch: its micro_batch_size, or under a token budget the rows of
    the longest rows that fit in it (the most tokens one micro-batch holds)."""
    rc = config.role(role)
    if rc.token_budget is not None:
        return max(1, rc.token_budget // config.sequence_tokens)
    return rc.micro_batch_size * config.rows_per_sample


def micro_batches_per_step(config: RLHFConfig, role: str, dp: int) -> int:
    """Micro-batches each DP rank runs per optimizer step of a trainable role."""
    return max(1, config.samples_per_step(role) * config.rows_per_sample // (micro_batch_rows(config, role) * dp))


@dataclasses.dataclass
class Plan:
    roles: Dict[str, Dict[str, int]]  # role -> kind -> bytes (resident when active)
    transient: Dict[str, Dict[str, int]]  # role -> activations / kv_cache
    phases: Dict[str, int]  # phase -> total device bytes
    resident: Dict[str, Dict[str, Dict[str, int]]]  # phase -> role -> kind -> bytes
    peak_phase: str
    layout: Dict[str, int]
    host: Dict[str, int]  # role -> bytes of its EMS host arenas (exact: what its switches copy)

    @property
    def peak_bytes(self) -> int:
        return self.phases[self.peak_phase]

    @property
    def host_bytes(self) -> int:
        """Host memory EMS holds on the rank: every role's arenas, all alive at once."""
        return sum(self.host.values())


def rollout_rows(config: RLHFConfig, role: str, world_size: int) -> int:
    """The rows of the rollout each of ``role``'s DP ranks holds, at the role's own layout."""
    own = config.layout_of(role)
    return config.rollout_samples // (world_size // own.replica_ranks())


def plan(config: RLHFConfig, world_size: int, switches: Optional[Dict[str, EMSSwitches]] = None,
         seq_length: Optional[int] = None) -> Plan:
    """The memory of one PPO iteration on the most loaded rank (the stage with most state)."""
    par = config.parallel
    tp, pp, ep = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size
    dp = world_size // par.replica_ranks()
    seq = seq_length or config.sequence_tokens
    # Roles still on free_memory: auto are planned with nothing offloaded (recommend() chooses).
    switches = switches or {r: EMSSwitches.from_role_config(config.role(r), auto=False) for r in config.model_roles}
    roles: Dict[str, Dict[str, int]] = {}
    transient: Dict[str, Dict[str, int]] = {}
    for name in config.model_roles:
        rc = config.role(name)
        trainable = name in config.trainable_roles
        # Each role at its own layout (RLHFConfig.layout_of), the run's padded vocabulary.
        own = config.layout_of(name)
        rtp, rpp, rcp = own.tensor_model_parallel_size, own.pipeline_model_parallel_size, own.context_parallel_size
        rdp, vocab = world_size // own.replica_ranks(), config.padded_vocab(rc.model)
        # the distributed optimizer's state is cut over DP x CP (CP ranks hold the same weights)
        stages = [state_bytes(rc, ROLE_HEADS[name], trainable, rtp, rpp, rdp * rcp, r, ep=own.expert_model_parallel_size,
                              lora=config.lora_of(name),
                              padded_vocab=vocab) for r in range(rpp)]
        roles[name] = max(stages, key=lambda s: sum(s.values()))
        # 1F1B: the first stage holds up to PP micro-batches' activations before its first backward.
        in_flight = min(rpp, micro_batches_per_step(config, name, rdp)) if trainable else 1
        rows, seq_of_role = rollout_rows(config, name, world_size), seq
        generates = name in GENERATING_ROLES and config.stage == "rl"
        if name == "judge":  # its verdicts: judge.samples per response, each prompt and verdict
            rows, seq_of_role = rows * config.judge.samples, config.judge.max_prompt_length + config.judge.max_new_tokens
        transient[name] = {
            "activations": in_flight * activation_bytes(rc.model, ROLE_HEADS[name], micro_batch_rows(config, name), seq, rtp, rpp,
                                                        rc.precision, rc.recompute_activations, trainable, vocab,
                                                        rc.attention, config.logprob_chunk_tokens(name), rcp),
            # The engine's slots and its scratch slot (generation/generate.slot_cache); only RL generates.
            "kv_cache": kv_cache_bytes(rc.model, config.generation.slots(rows) + 1, seq_of_role, rtp, rpp,
                                       rc.precision) if generates else 0,
            "decode_step": decode_step_bytes(rc.model, config.generation.slots(rows) + 1, seq_of_role, rtp, rpp,
                                             rc.precision, vocab) if generates else 0,
            "reshard_buffers": reshard_buffer_bytes(config, name, world_size),
        }
    # Host arenas: one per copied kind (grads are freed, never copied). A serving role that shares
    # its trained role's weights has none of its own; its offload_weights moves the owner's.
    host = {name: sum(kinds[k] for k in switches[name].kinds() if k != GRADS) for name, kinds in roles.items()}
    for serving in config.served_weights:
        owner = config.weight_owner(serving) if serving in roles else None
        if owner:
            host[serving] -= roles[serving][WEIGHTS] if switches[serving].offload_weights else 0
            if switches[serving].offload_weights and not switches[owner].offload_weights:
                host[owner] += roles[owner][WEIGHTS]
            roles[serving] = dict(roles[serving], **{WEIGHTS: 0})
    phases, resident = {}, {}
    for phase, active, extras in _phases(config):
        active_owner = config.weight_owner(active)
        table = {}
        for name, kinds in roles.items():
            kept = set(KINDS) - set(switches[name].kinds())
            if name == active:
                kept |= set(PHASE_NEEDS["training" if name in config.trainable_roles else "inference"])
            if name == active_owner:
                kept.add(WEIGHTS)  # the active role runs on these weights
            table[name] = {k: v for k, v in kinds.items() if k in kept}
        table.setdefault(active, {}).update({extra: transient[active][extra] for extra in extras})
        resident[phase] = table
        phases[phase] = sum(sum(t.values()) for t in table.values())
    for serving, trained in config.served_weights.items():
        if serving in roles and transient[serving]["reshard_buffers"]:  # both roles' weights and the buffers
            table = {name: {k: v for k, v in kinds.items() if k not in switches[name].kinds() or
                            (k == WEIGHTS and name in (serving, trained))} for name, kinds in roles.items()}
            table[serving]["reshard_buffers"] = transient[serving]["reshard_buffers"]
            resident[f"sync_{serving}"] = table
            phases[f"sync_{serving}"] = sum(sum(t.values()) for t in table.values())
    peak = max(phases, key=phases.get)
    return Plan(roles, transient, phases, resident, peak, {"tp": tp, "pp": pp, "cp": par.context_parallel_size, "dp": dp, "ep": ep, "seq": seq}, host)


def overlap_fits(config: RLHFConfig, p: Plan, current: str, following: str, budget: int) -> bool:
    """Whether ``following``'s onload can run while ``current`` computes: ``current``'s phase plus
    what ``following`` needs that is off the device then stays within ``budget`` bytes."""
    phase = next(phase for phase, active in config.phase_order if active == current)
    trainable = following in config.trainable_roles
    needs = [(following, k) for k in PHASE_NEEDS["training" if trainable else "inference"]]
    owner = config.weight_owner(following)
    if owner:  # a serving role runs on its owner's weights
        needs = [(owner if k == WEIGHTS else following, k) for _, k in needs]
    extra = sum(p.roles[r][k] for r, k in needs if k not in p.resident[phase].get(r, {}))
    return p.phases[phase] + extra <= budget


def recommend(config: RLHFConfig, world_size: int, budget: int, seq_length: Optional[int] = None,
              free_roles: Optional[Tuple[str, ...]] = None) -> Tuple[Optional[Dict[str, EMSSwitches]], Plan]:
    """The least offloading that fits ``budget`` bytes: starting from every switch off, turn on
    one at a time the switch that lowers the peak most (or, where phases tie at the peak, the sum
    over phases most), until it fits. ``free_roles``: the roles whose switches may be chosen
    (default: all); the others keep their configured switches. Returns (switches, plan);
    switches is None when even everything offloaded does not fit."""
    free_roles = config.model_roles if free_roles is None else free_roles
    off = EMSSwitches(offload_weights=False, free_grad_buffers=False, offload_optimizer_state=False)
    chosen = {r: off if r in free_roles else EMSSwitches.from_role_config(config.role(r), auto=False)
              for r in config.model_roles}
    current = plan(config, world_size, chosen, seq_length)
    options = [(r, f) for r in free_roles for f in EMS_SWITCHES
               if r in config.trainable_roles or f == "offload_weights"]
    def score(p: Plan) -> Tuple[int, int]:
        return p.peak_bytes, sum(p.phases.values())

    while current.peak_bytes > budget:
        best = None
        for role, field in options:
            if getattr(chosen[role], field):
                continue
            trial = dict(chosen, **{role: dataclasses.replace(chosen[role], **{field: True})})
            candidate = plan(config, world_size, trial, seq_length)
            if best is None or score(candidate) < score(best[1]):
                best = (trial, candidate)
        if best is None or score(best[1]) >= score(current):
            return None, current
        chosen, current = best
    return chosen, current


@dataclasses.dataclass
class CheckpointPlan:
    """A checkpoint save (checkpoint/run_checkpoint.py): every rank writes its own part of the
    distributed optimizer's state (fp32 main parameters and both Adam moments of the range it owns:
    1/DP of its slice's), and DP rank 0 of each model-parallel slice also the slice's weights; each
    copied to host memory first, one trained role at a time, nothing gathered. Without the
    distributed optimizer DP rank 0 writes the slice's whole optimizer state."""

    writer: Dict[str, Dict[str, int]]  # trained role -> weights / optimizer_state bytes DP rank 0 of a slice writes
    other: Dict[str, int]  # trained role -> optimizer_state bytes every other rank writes
    writers_per_node: int  # DP ranks 0 on the busiest node
    nproc_per_node: int
    background: bool = False  # trainer.async_save: every role's copy held until the writer is done

    @property
    def writer_bytes(self) -> int:
        """Bytes DP rank 0 of a slice writes, every trained role's."""
        return sum(sum(kinds.values()) for kinds in self.writer.values())

    @property
    def other_bytes(self) -> int:
        return sum(self.other.values())

    @property
    def writer_peak(self) -> int:
        """Host bytes DP rank 0 of a slice holds at once: one role's copy (the roles are saved in
        turn), or every role's with background saves."""
        per_role = [sum(kinds.values()) for kinds in self.writer.values()]
        return sum(per_role) if self.background else max(per_role)

    @property
    def node_bytes(self) -> int:
        """The copies on the busiest node during a save (beside the EMS arenas)."""
        other = sum(self.other.values()) if self.background else max(self.other.values())
        return self.writer_peak * self.writers_per_node + other * (self.nproc_per_node - self.writers_per_node)


def checkpoint_plan(config: RLHFConfig, world_size: int, nproc_per_node: Optional[int] = None) -> CheckpointPlan:
    """What a checkpoint save copies and writes on a rank (its most loaded pipeline stage) and on
    the busiest node; ranks numbered as megatron numbers them (TP fastest, then DP, then PP)."""
    par = config.parallel
    tp, pp, ep = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size
    dp, nproc = world_size // (tp * pp), nproc_per_node or world_size
    writer: Dict[str, Dict[str, int]] = {}
    other: Dict[str, int] = {}
    for name in config.trainable_roles:
        rc, head, lora = config.role(name), ROLE_HEADS[name], config.lora_of(name)
        vocab = config.padded_vocab(rc.model)
        stages = []
        for r in range(pp):
            dense = param_numels(rc.model, head, tp, pp, r, vocab)
            numels = dense + expert_numels(rc.model, tp, pp, r, 1)  # the weights file holds every expert
            if lora is not None and lora.enabled:
                owned = sum(lora_numels(rc.model, lora, tp, pp, r)) / dp
            else:  # each DP rank owns 1/DP of the dense parameters, each expert-DP rank 1/(DP/EP) of its experts
                owned = sum(dense) / dp + sum(expert_numels(rc.model, tp, pp, r, ep)) / (dp // ep)
            shared = 12 * int(owned)  # an fp32 main copy and two moments per owned parameter
            slice_state = shared
            if not rc.use_distributed_optimizer:  # DP rank 0 writes the slice's whole state, the others none
                slice_state, shared = shared * dp, 0
            stages.append(({WEIGHTS: sum(numels) * BYTES[rc.precision], OPTIMIZER_STATE: slice_state}, shared))
        kinds, shared = max(stages, key=lambda s: sum(s[0].values()))
        writer[name], other[name] = kinds, shared
    ranks_per_node = [range(n, min(n + nproc, world_size)) for n in range(0, world_size, nproc)]
    busiest = max(sum(1 for rank in ranks if (rank // tp) % dp == 0) for ranks in ranks_per_node)
    return CheckpointPlan(writer, other, busiest, nproc, config.trainer.async_save)
