"""What each torchrun worker script finds: one declared record per worker (tests/workers/<name>.py),
shared by the worker that fills it and the test that reads it.

A worker builds its record (``Record(field=...)``, or ``Record.to_fill()`` and its fields set one by
one) and ``common.save``s it, which refuses a field left unset; conftest.run_workers checks each
rank's record is the worker's declared type. A field misspelt on either side fails where it is
written, by name: the records are slotted dataclasses. Keys that stay in dicts are data (a layout,
a role, a metric's name), not fields."""

from dataclasses import MISSING, dataclass, fields
from typing import Any, Optional

from torch import Tensor

Metrics = dict[str, float]  # a controller's metrics by name (megatron_rlhf's own keys)
StateDict = dict[str, Tensor]  # tensors by parameter name

FINDINGS: dict[str, type] = {}  # worker script's name -> its record type


class Findings:
    """Base of the records (slotted dataclasses, keyword-only)."""

    __slots__ = ()

    @classmethod
    def to_fill(cls):
        """A record whose fields are set one by one (those with a default start at it)."""
        record = object.__new__(cls)
        for f in fields(cls):
            if f.default is not MISSING:
                setattr(record, f.name, f.default)
            elif f.default_factory is not MISSING:
                setattr(record, f.name, f.default_factory())
        return record

    def unset(self) -> list[str]:
        return [f.name for f in fields(self) if not hasattr(self, f.name)]


def part(cls):
    """A record nested in a worker's record."""
    return dataclass(kw_only=True, slots=True)(cls)


def findings_of(worker: str):
    """Declares the class as the record of tests/workers/<worker>.py."""
    def declare(cls):
        record = part(cls)
        FINDINGS[worker] = record
        return record
    return declare


# -- Models, checkpoints and generation ------------------------------------------------------------

@part
class ChunkedRun:
    inference: list  # per micro-batch, the log-probs of a forward-only pass [2, 10] (last stage; [] elsewhere)
    metrics: list[Metrics]  # the policy loss's sums, per micro-batch of both steps (last stage)
    grad_norms: list[float]  # of the two steps
    grads: StateDict  # every parameter's main_grad after the first step
    chunked: Optional[int]  # the model's logprob_chunk_tokens (None: a stage without the LM head)


@findings_of("chunked_log_probs")
class ChunkedLogProbs(Findings):
    runs: dict[tuple, ChunkedRun]  # (layout, logprob_chunk_tokens) -> its run


@part
class ContextParallelRun:
    log_probs: list  # per micro-batch, a forward-only pass's log-probs [2, 12] (last stage; [] elsewhere)
    values: list  # per micro-batch, a value head's forward-only values [2, 12]
    figures: dict[str, list[Metrics]]  # loss -> each optimizer step's metric sums over the step's rows (every rank's)
    grad_norms: dict[str, list[float]]  # loss -> the grad norm of each of its steps
    grads: dict[str, StateDict]  # loss -> every parameter's gradient after its first step
    weights: dict[str, StateDict]  # loss -> every parameter after its last step


@findings_of("context_parallel")
class ContextParallel(Findings):
    runs: dict[str, ContextParallelRun]  # layout -> its run


@findings_of("checkpoint_forward")
class CheckpointForward(Findings):
    tokens: Tensor  # the fixed [2, 10] tokens fed
    outputs: dict[str, Optional[Tensor]]  # checkpoint -> the full output (logits over the vocabulary, or
    # scores); None off the last stage


@findings_of("family_equivalence")
class FamilyEquivalence(Findings):
    tokens: Tensor  # the [2, 20] tokens of the forward
    prompts: Tensor  # the greedy generation's prompts, [8, 30]
    lengths: list[int]  # each prompt's length
    outputs: dict[tuple[str, str], Tensor]  # (case, layout "tpT_ppP[_epE]") -> full output; last stage only
    generated: dict[tuple[str, str], list[list[int]]]  # (case, layout) -> each row's response (LM heads)
    generated_unequal: dict[tuple[str, str], list[list[int]]]  # at EP > 1: rank 0 all rows, rank 1 two


@part
class Generated(Findings):
    tokens: Tensor  # [rows, width] prompts and responses
    response_lengths: Tensor
    stats: Any = None  # generation's GenerationStats, where kept


@findings_of("generation_equivalence")
class GenerationEquivalence(Findings):
    nocache: tuple[Tensor, Tensor]  # (tokens, produced) of argmax over the full forward at every step
    nocache_eos: tuple[Tensor, Tensor]  # the same with the end token
    eos: int  # the end token: the one row 0 emits third
    stats_reference: tuple[Tensor, Tensor]  # (log-probs, entropies) of the full softmax at temperature 0.7
    stats: dict[str, Optional[tuple[Tensor, Tensor]]]  # layout "tp1" / "tpT_ppP" -> vocab-parallel (log-probs, entropies)
    greedy: dict[str, Generated]  # layout "tp1" / "tpT_ppP" -> greedy tokens
    tp1_left: Generated  # left-padded prompts
    tp1_wide: Generated  # prompts padded 300 wider
    tp1_eos: Generated
    turns_prefilled: tuple[list[list[int]], int]  # (rows after four turns, tokens fed) prefilling every turn
    turns_kept: tuple[list[list[int]], int]  # the cache kept in 4 slots
    turns_kept_2_slots: tuple[list[list[int]], int]  # in 2 slots for 4 rows
    tp2_pp2_turns_kept: tuple[list[list[int]], int]
    turns_open: dict[str, tuple[list[list[int]], int]]  # "<slots>_slots_delays_<per row>" -> turns in an open run
    tp2_pp2_turns_open: tuple[list[list[int]], int]  # 2 slots, delays 5 0 2 9
    tp2_pp2_eos: Generated
    tp2_pp2_eos_by_3: Generated  # 3 rows at a time
    # that run's decode steps: {"steps", "copies": input copies, "shapes": {(rows, extent)},
    # "host_reads": tensor values read on the host after a step's copy}
    decode_steps: dict
    tp2_pp2_eos_packed: Generated  # every linear on packed weights
    tp2_pp2_eos_torch_linears: Generated  # torch's F.linear
    packed_products: int  # products the engine ran on packed weights
    megatron_products_restored: bool  # no engine forward left on megatron's modules after
    sampled: Generated  # top-k/top-p sampling at TP2 x PP2


@findings_of("decode_graphs_gpu")
class DecodeGraphsGPU(Findings):
    # run ("greedy", "sampled", "resumed", "turns", "open") -> (tokens, log-probs, decode steps replayed)
    graphed: dict[str, tuple[Tensor, Tensor, int]]
    eager: dict[str, tuple[Tensor, Tensor, int]]  # the same with MEGATRON_RLHF_DECODE_GRAPHS=off
    allocated_after: tuple[int, int]  # allocated bytes before and after the graphed runs (their second time)
    first_runs_kept: int  # bytes the first graphed runs left allocated (caches of first use)
    capture_stream_workspaces: int  # bytes the libraries kept for torch's capture stream (taken before)


@findings_of("pool_state")
class PoolState(Findings):
    pid: int  # the process that ran the case
    left_behind: list[str]  # what an earlier case in the same pool left changed, by name


@findings_of("generation_vs_hf")
class GenerationVsHF(Findings):
    prompts: Tensor
    lengths: list[int]
    greedy: dict[str, Generated]  # layout "tpT_ppP" -> greedy rows (with stats); "tp2_pp2_lag2": EOS learnt 2 steps late


@findings_of("models_equivalence")
class ModelsEquivalence(Findings):
    errors: dict[tuple[str, str], Optional[float]]  # (head, layout) -> max |output - TP=1's|; None off the last stage
    round_trips: dict[tuple[str, str], bool]  # (head, layout) -> gathered shards rebuild the full state exactly
    bf16_losses: list[float]  # TP2 x PP2 bf16 training, per step (last stage)
    bf16_param_dtype: str


@findings_of("dp_step")
class DPStep(Findings):
    dp: int
    runs: dict[str, "DPRun"]  # variant ("dist", "local", "dist+recompute", "dist+local_attention") -> its steps


@part
class DPRun(Findings):
    params: StateDict  # after 3 steps
    moved: float  # the largest change of any parameter
    recompute: Optional[str]  # megatron's recompute_granularity as built
    core_attention: str  # the class of the first layer's core attention
    grad_norms: list  # each step's gradient norm


@findings_of("gpu_vs_cpu")
class GPUvsCPU(Findings):
    precision: str
    device: str
    token_log_probs: Tensor  # [4, 31]
    greedy: Tensor  # [4, 16] generated tokens
    losses: list[float]  # 4 training steps
    margins: Optional[Tensor] = None  # the CPU run's: fp32 lead of each greedy choice over the runner-up
    weights: Optional[StateDict] = None  # the CPU run's, loaded by the GPU run


@findings_of("lora")
class LoRA(Findings):
    b0_equal: bool  # B = 0: the base's logits exactly
    off_equal: bool  # adapters off: the base's logits exactly
    lora_moves: float  # max |logits with random B - base's|
    merged: float  # max |logits - the merged base's|
    base_without_grads: bool
    lora_logits: Tensor  # TP=1's logits, [2 micro-batches, 2, 12, 100]
    tokens: Tensor  # their tokens
    a_init: dict[str, bool]  # layout "tpT_ppP" -> A starts as at TP=1
    logits: dict[str, Optional[float]]  # layout -> max |logits - TP=1's|; None off the last stage
    grads: dict[str, float]  # layout -> max relative difference of the gathered adapter grads


@findings_of("layouts")
class Layouts(Findings):
    rank: int
    stages: dict[str, int]  # serving model ("tp1", "pp2") -> this rank's pipeline stage in it
    full: dict[str, StateDict]  # "start" / "changed" -> the TP=2 model's full weights
    served: dict[tuple[str, str], StateDict]  # (when, serving model) -> its local weights after the sync
    logits_trained: Tensor
    logits_tp1: Tensor


@findings_of("weight_sync")
class WeightSync(Findings):
    shared: bool  # same dtype: the sync shares storage
    same_storage: bool
    policy_weight_bytes: int  # counted once: the policy holds none of its own
    owner_onloaded_with_policy: bool
    owner_offloaded_after: bool
    shared_equal_after_step: bool
    copy_shared: bool  # bf16 serving of fp32 training: shares nothing
    copied_at_start: bool
    stale_before_sync: bool
    copied: bool


# -- Memory (EMS) ----------------------------------------------------------------------------------

@part
class EMSOnAndOff(Findings):
    on: Any  # the run with EMS on
    off: Any  # and off


@part
class EMSTrained(Findings):
    losses: list[float]
    params: StateDict
    state: StateDict  # the optimizer's tensors
    moved: list[dict[str, int]]  # resident bytes by kind between steps (EMS on)
    resident: dict[str, int]  # while training


@findings_of("ems_bitexact")
class EMSBitExact(Findings):
    runs: dict[str, EMSOnAndOff]  # "tpT_dpD_{precision}_{dist|local}" -> EMSTrained on and off


@part
class RSSDrop(Findings):
    before: int
    after: int
    freed_state_bytes: int
    by_kind: dict[str, int]
    after_kinds: dict[str, int]


@findings_of("ems_units")
class EMSUnits(Findings):
    offloaded_and_host_bytes: tuple[int, int]
    idempotent_offload_host_bytes: tuple[int, int]  # host bytes before and after a second offload
    onload_twice_same: bool
    host_buffers_reused: bool
    inference_resident: dict[str, int]
    copied_by_inference_offload: int
    copied_after_plain_onload: int
    grads_in_use: str  # the refusal to offload gradients mid-accumulation
    grads_kept: int
    grads_freed_after_step: int
    clean_offload_reports: list
    leak_warning: list[str]
    planted_bytes: int
    leak_error: str
    fixed_addresses: str
    fixed_addresses_without_ems: tuple
    rss: RSSDrop


@findings_of("ems_six_roles")
class EMSSixRoles(Findings):
    runs: dict[str, "SixRolesRun"]  # free_memory "on" / "off" -> its run


@part
class SixRolesRun(Findings):
    records: list[dict]  # the ledger's records (its own format, as in memory.jsonl)
    full_bytes: dict[str, dict[str, int]]  # role -> resident bytes by kind while it ran
    path: str  # the ledger's file
    peak: int


@part
class GPURound(Findings):
    before: tuple[int, int]  # (allocated, reserved)
    during: tuple[int, int]
    after: tuple[int, int]
    state: int


@findings_of("ems_gpu")
class EMSGPU(Findings):
    rounds: list[GPURound]
    pinned: list[bool]


@part
class ColocatedPhase(Findings):
    role: str
    start: int  # allocated before the onload (above the baseline)
    onloaded: int
    state: int  # the role's state bytes (ledger count)
    # bytes the onload asked the allocator for: "allocated" also counts what a block has over a
    # request (the caching allocator hands out a whole block when under 1 MiB of it would be left)
    requested: int
    peak: int


@part
class Colocated(Findings):
    phases: list[ColocatedPhase]
    full_state: dict[str, int]


@findings_of("ems_six_roles_gpu")
class EMSSixRolesGPU(Findings):
    on: Colocated
    off: Colocated


@part
class PlannedRole(Findings):
    layout: tuple  # (tp, pp, ep, distributed optimizer, precision, features)
    role: str
    measured: dict[str, int]
    planned: dict[str, int]
    idle: dict[str, int]


@part
class PlannedSync(Findings):
    layouts: tuple[int, int, int]  # (run TP, policy TP, policy PP)
    recorded: int
    planned: int
    stage: int


@findings_of("planner_state")
class PlannerState(Findings):
    roles: list[PlannedRole]
    syncs: list[PlannedSync]


# -- The update's invariance -----------------------------------------------------------------------

@part
class UpdateStep(Findings):
    grads: StateDict  # full gradients after the step's backward
    loss: float  # the reported loss
    moe: Optional[dict] = None  # the load-balancing losses (MoE)


@findings_of("ppo_invariance")
class PPOInvariance(Findings):
    steps: dict[tuple[str, str, str], UpdateStep]  # (head, loss_agg_mode, cut) -> the step


@findings_of("moe_invariance")
class MoEInvariance(Findings):
    steps: dict[tuple[float, str], UpdateStep]  # (load-balancing coefficient, cut) -> the step


@findings_of("ppo_edge_cases")
class PPOEdgeCases(Findings):
    tp_ranks_agree: bool  # sampled tokens with the TP ranks' streams forced apart
    grad_norms: dict[float, float]  # clip_grad -> reported grad norm


@part
class Replayed(Findings):
    engine: Tensor  # routes the engine recorded while generating
    record: Tensor  # the old-log-prob pass's record
    lengths: Tensor
    layers: int  # routers on this stage
    recorded_inference: Tensor  # what the old-log-prob pass routed, seen by hooks
    routed: dict[tuple[str, str], Tensor]  # ("replayed" | "free", "inference" | "training") -> routed experts


@findings_of("routing_replay")
class RoutingReplay(Findings):
    experts: int
    ep2: Replayed
    pp2: Replayed


# -- Iterations of the controller ------------------------------------------------------------------

@part
class Iteration(Findings):
    metrics: Metrics  # times left out
    weights: Any = None  # a digest or the weights themselves, as the worker says


@findings_of("dp_iteration")
class DPIteration(Findings):
    ppo: Iteration  # weights: the sum of each full tensor of ppo_policy
    grpo: Iteration
    grpo_lora: Optional[Iteration] = None  # at DP <= 2
    game: Optional[Iteration] = None  # at DP <= 2
    game_tp2: Optional[Iteration] = None  # on 2 processes


@findings_of("family_iteration")
class FamilyIteration(Findings):
    families: dict[str, EMSOnAndOff]  # family -> Iteration (weights: role -> local state) on and off


@findings_of("dynamic_sampling")
class DynamicSampling(Findings):
    prompts: list[str]  # each kept row's prompt, in order
    scores: Tensor
    metrics: Metrics
    served: list[str]  # the prompts the dataset served, in order
    advantages: Tensor
    mask: Tensor


@findings_of("ppo_checkpoint_crash")
class PPOCheckpointCrash(Findings):
    error: Optional[str]  # the failed save's error
    read_only_error: Optional[str]  # a save into a folder torch.save cannot write (its RuntimeError)
    background_error: Optional[str]  # the same failure in a background save, when drained
    first: str  # the first checkpoint's path
    latest: str  # latest_checkpoint after the failure
    resumed_iteration: int
    listing: list[str]  # the checkpoints directory
    map_locations: list  # torch.load's map_location of every load
    # A background save held in flight: the writer's tensors (count, bytes, whether any shares a
    # role's device storage or EMS host arena, whether any is page-locked), every role's resident
    # bytes meanwhile, and the checkpoint it finished.
    writer_holds: dict
    resident_while_writing: dict[str, int]
    held_save: str


@part
class RoleLayoutRun(Findings):
    columns: dict[str, Tensor]  # the rollout's columns
    metrics: Metrics
    layouts: dict[str, tuple[int, int, int]]  # role -> (tp, pp, ep)


@part
class LoRAServed(Findings):
    tokens: Tensor  # the second iteration's rollout
    old_log_probs: Tensor
    action_mask: Tensor
    layouts: dict[str, tuple[int, int, int]]
    metrics: list[Metrics]  # both iterations'
    bytes: dict[str, int]  # "adapters" / "base" -> the policy's bytes of each


@findings_of("role_layouts")
class RoleLayouts(Findings):
    same: dict[str, RoleLayoutRun]  # "greedy", "sampled", "moe/greedy", "moe/sampled": every role at the run's layout
    mixed: dict[str, RoleLayoutRun]  # the same runs with roles at layouts of their own
    mixed_ems_off: RoleLayoutRun  # mixed, sampled, EMS off
    resume_whole: Metrics
    resume_resumed: Metrics
    lora: dict[str, LoRAServed]  # "same" / "mixed"


@findings_of("lora_recompute")
class LoRARecompute(Findings):
    grads: dict[str, StateDict]  # "on" / "off" (recompute) -> each adapter's gradient
    grad_norms: dict[str, float]
    unfixed: str  # the training pass's error with recompute before its fix ("trained": none)


@findings_of("lora_run")
class LoRARun(Findings):
    reference_views: bool  # the reference's parameters are views of ppo_policy's base
    reference_owner: bool
    reference_weight_bytes: int
    base_unchanged: bool
    adapters_moved: bool
    adapter_tensors: int
    adapter_numel: int
    base_numel: int
    optimizer_numel: int
    reference_log_probs_equal: bool
    load_lora_equal: bool
    whole: list[Metrics]  # both iterations, uninterrupted
    resumed: list[Metrics]  # iteration 2 from the checkpoint


@part
class GameRun(Findings):
    metrics: Metrics
    rollout: dict[str, Tensor]  # tokens, mask, scores, advantages gathered over DP


@findings_of("multiturn")
class MultiTurn(Findings):
    single: Metrics
    silent: Metrics
    fails_on_rank_1: Metrics
    fails_everywhere: tuple[str, bool]  # (the error, raised after a collective)
    tools: Metrics
    game: GameRun
    game_ems_off: GameRun
    game_mbs1: GameRun
    game_policy_tp1: GameRun  # the policy at TP=1 x DP=2 of its own while the run is at TP=2
    game_lockstep: GameRun  # rollout.overlap_turns false
    game_correction: GameRun  # algorithm.rollout_correction truncate: with the behaviour and old log-probs
    game_2_slots_late_replies: GameRun  # 2 decode slots, replies late by 0-60 ms by trajectory


@part
class FrozenRun(Findings):
    metrics: list[Metrics]
    rows: list[dict[str, Tensor]]  # every round's trained rows (all ranks')
    one_go: list[dict[str, Tensor]]  # the same responses generated in one call


@part
class ResumedRun(Findings):
    whole: list[Metrics]
    resumed: list[Metrics]
    held_groups: int  # unfinished groups held at the checkpoint
    held_unfinished: int


@findings_of("partial_rollouts")
class PartialRollouts(Findings):
    lr0: FrozenRun
    resume: ResumedRun


@findings_of("partial_trajectories")
class PartialTrajectories(Findings):
    lr0: FrozenRun  # one_go: the trained trajectories played in one go (tokens, action_mask, behaviour)
    resume: ResumedRun



# -- The stages before RL (SFT, reward models, DPO) ----------------------------------------------

@findings_of("preference_losses")
class PreferenceLosses(Findings):
    losses: Metrics  # case -> the loss of our loss function on the batch (sum / count)
    metrics: dict[str, Metrics]  # case -> our metric sums as means (stages/losses.py MEANS)
    grads: dict[str, StateDict]  # case -> every parameter's gradient, under its Hugging Face name


@part
class StageRun(Findings):
    steps: list[Metrics]  # each optimizer step's metrics
    validation: Metrics  # after the last step
    weights: Optional[StateDict]  # the trained role's full weights from its checkpoint (rank 0; None elsewhere)


@findings_of("stage_invariance")
class StageInvariance(Findings):
    runs: dict[str, StageRun]  # cut (layout, micro-batches, EMS, resume) -> its run


# -- Collectives ---------------------------------------------------------------------------------

@findings_of("host_collectives")
class HostCollectives(Findings):
    runs: list  # the runs made through the run's own entry, by name, each to its end
    violations: list  # "file:line: what" of every collective NCCL would refuse or a control one on a device group
    host_sites: dict  # "file:function" of every collective on a host group -> how many
    metrics: dict  # run name -> its metrics (each step's)


@findings_of("stage_runs")
class StageRuns(Findings):
    metrics: dict  # "STAGE:plain" / "STAGE:auto_overlap" -> each step's metrics (run_loop.run's)
    printed: dict  # the same keys -> what rank 0 printed
    auto_choice: dict  # stage -> free_memory_auto.json of its auto run


@findings_of("batch_invariance")
class BatchInvariance(Findings):
    # precision -> what the mode gave: row 0 alone against 1, 7, 63 others and 63 in 8 slots (tokens,
    # log-probs equal), rows whose behaviour log-probs equal the training forward's bit for bit, rows,
    # tokens, the training forward's row alone equal to it in a batch
    on: dict[str, dict]
    off: dict[str, dict]  # precision -> the same rows with the mode off: rows equal, the largest gap
    grpo: dict[str, dict]  # trainer.batch_invariant "true" / "false" -> an iteration's metrics (rollout correction on)
    game: dict[str, tuple]  # agent game schedule -> (tokens, behaviour log-probs) of its trajectories, bf16, the mode on


@findings_of("judge_runs")
class JudgeRuns(Findings):
    # run ("ems_on", "ems_off", "judge_tp2", "short_prompts") -> each iteration's metrics, but times and sync bytes
    metrics: dict[str, list]
    scores: dict[str, Tensor]  # run -> the last iteration's scores (every DP rank's rows)
    records: list[dict]  # the memory ledger's records of the ems_on run
    planned: dict[str, dict]  # the planner's phase -> role -> kind -> bytes of the ems_on run's config
    # the process reward model's iteration: its metrics, and its rollout's tokens, prompt and response
    # lengths, scores and per-action step rewards (this rank's rows)
    process_reward: dict


@findings_of("prm_losses")
class PRMLosses(Findings):
    cases: dict[str, dict]  # case -> {"loss", "step_accuracy", "val_loss", "val_step_accuracy", "grads", "ids"}
