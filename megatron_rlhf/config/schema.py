"""Typed configuration objects. Field names are the YAML keys; defaults are the values used when a
key is absent. Only these keys are accepted: anything else is an error naming file and key."""

from __future__ import annotations

import dataclasses
import math
import operator
import os
from typing import Dict, List, Literal, Optional, Union

from megatron_rlhf.config.errors import located
from megatron_rlhf.config.names import (ADVANTAGE_ESTIMATORS, CORRECTION_LEVELS, CRITIC_ESTIMATORS, KL_ESTIMATORS,
                                        DPO_LOSSES, JUDGE_COMBINES, JUDGE_PARSERS, LORA_TARGETS, LOSS_AGG_MODES,
                                        POLICY_LOSSES, STEP_AGGREGATIONS,
                                        ROLLOUT_CORRECTIONS, SANDBOX_KINDS, STAGES, TOOL_PARSERS)


@dataclasses.dataclass(frozen=True)
class Domain:
    """The values a numeric key takes: every bound given must hold (None: no bound)."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None

    def problem(self, value) -> Optional[str]:
        """None, or what is wrong with ``value`` ("must be >= 1, got 0"); a key that also takes a
        word (``micro_batch_size: auto``) has its words checked by its type, not here."""
        if isinstance(value, str):
            return None
        bounds = [(op, bound, holds) for op, bound, holds in (
            (">=", self.ge, operator.ge), (">", self.gt, operator.gt), ("<=", self.le, operator.le), ("<", self.lt, operator.lt),
        ) if bound is not None]
        if all(holds(value, bound) for _, bound, holds in bounds):
            return None
        return "must be " + " and ".join(f"{op} {bound:g}" for op, bound, _ in bounds) + f", got {value}"


def bounded(default, **domain) -> dataclasses.Field:
    """A numeric key and its domain (ge, gt, le, lt): the one home of what values it takes;
    validation.domain_problems checks every key so marked, all at once."""
    return dataclasses.field(default=default, metadata={"domain": Domain(**domain)})

# PPO's six roles (with a critic); every role, the LLM judge too (built where judge.enabled).
PPO_ROLES = ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value")
ROLE_NAMES = PPO_ROLES + ("judge",)
TRAINABLE_ROLES = ("ppo_policy", "ppo_value")
# The source of a key=value of the command line, in messages; a relative path it gives is the working directory's.
COMMAND_LINE = "the command line"
# The phases of one iteration in the order they run, each with its active role (a role the run does
# not build is skipped): the controller runs them so, the planner plans them so, and overlapped
# onloads follow from it (RLHFConfig.successions).
PHASE_ORDER = (("generate", "policy"), ("reward", "reward"), ("judge", "judge"), ("reference", "reference"),
               ("value", "value"), ("train_policy", "ppo_policy"), ("train_value", "ppo_value"))
# The critic: the roles that only an estimator with a learned value baseline (GAE) builds.
CRITIC_ROLES = ("value", "ppo_value")
# Weight sync: each serving role runs the weights its trained role learns (same network). Where both
# have the same precision the serving role's parameters are views of the trained role's storage.
SERVED_WEIGHTS = {"policy": "ppo_policy", "value": "ppo_value"}
# The roles that only run forwards: each may have a layout of its own (RoleConfig.parallel).
SERVING_ROLES = ("policy", "reference", "reward", "value", "judge")
# The roles that generate with the engine (their phases hold a KV cache and the decode step).
GENERATING_ROLES = ("policy", "judge")
# The roles that run the policy network: they record (policy) and replay (both) its routing.
REPLAYING_ROLES = ("policy", "ppo_policy")
# The stages before RL (SFT, reward-model training, DPO; megatron_rlhf/stages): the roles each runs,
# the one it trains, and its phases in order (the planner plans them; EMS moves the roles between).
STAGE_ROLES = {"sft": ("policy",), "rm": ("reward",), "prm": ("reward",), "dpo": ("policy", "reference")}
STAGE_TRAINED = {"sft": "policy", "rm": "reward", "prm": "reward", "dpo": "policy"}
STAGE_PHASES = {"sft": (("train_policy", "policy"),), "rm": (("train_reward", "reward"),),
                "prm": (("train_reward", "reward"),), "dpo": (("reference", "reference"), ("train_policy", "policy"))}
# What one sample of each stage's data is: a prompt (RL), a demonstration row (SFT), a preference pair.
SAMPLE_UNITS = {"rl": "prompts", "sft": "rows", "rm": "pairs", "prm": "rows", "dpo": "pairs"}
# What a stage before RL does not read: RL's sections and RL's prompt data and validation by
# generation (a key set in one is refused by name; the dry run leaves them out).
RL_ONLY_SECTIONS = ("generation", "rollout", "ppo", "algorithm", "moe")
RL_ONLY_KEYS = ("data.prompt_file", "data.prompt_key", "data.max_prompt_length", "data.overlong_prompts",
                "trainer.val_samples_per_prompt", "trainer.val_greedy")
STAGE_ONLY_KEYS = ("data.train_file",)  # what RL does not read (refused by name in RL)
# Which head each role's network ends in: vocabulary logits or one scalar per token.
ROLE_HEADS = {
    "policy": "lm",
    "reference": "lm",
    "ppo_policy": "lm",
    "reward": "scalar",
    "value": "scalar",
    "ppo_value": "scalar",
    "judge": "lm",
}


# What a network needs, from its own keys or its preset.
REQUIRED_ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                        "max_position_embeddings")


# Keys of an architecture that only training reads (the forward is the same whatever they are).
TRAINING_ONLY_ARCH_FIELDS = ("moe_aux_loss_coeff", "moe_z_loss_coeff")


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The global layer numbers pipeline stage ``pp_rank`` of ``pp_size`` holds: an even split, as
    megatron makes it (the one rule of the pipeline split: models, checkpoints, the planner)."""
    if num_layers % pp_size != 0:
        raise ValueError(f"PP={pp_size} does not divide num_layers={num_layers}")
    per_stage = num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


@dataclasses.dataclass
class ModelArchConfig:
    """A decoder of the Llama line: RMSNorm, SwiGLU, RoPE, grouped-query attention, and the
    features that tell its families apart (config/families.py: Llama 2/3, Qwen2/2.5, Qwen3,
    Mistral, and the mixtures of experts Qwen3-MoE and Mixtral). ``preset`` fills every field not
    given explicitly; ``family`` fixes the features the family always has (Qwen2's QKV bias, Qwen3's
    q/k norm) and names the Hugging Face config it converts to and from."""

    # a named architecture (config/presets.py: tiny, llama2-7b, ...) filling every key not given
    preset: Optional[str] = None
    # llama, qwen2, qwen3, mistral, qwen3_moe, mixtral (config/families.py): the family's features
    family: str = "llama"
    num_layers: Optional[int] = bounded(None, ge=1)  # decoder layers
    hidden_size: Optional[int] = bounded(None, ge=1)  # width of the residual stream
    num_attention_heads: Optional[int] = bounded(None, ge=1)  # query heads
    num_query_groups: Optional[int] = bounded(None, ge=1)  # None: as many KV heads as query heads
    ffn_hidden_size: Optional[int] = bounded(None, ge=1)  # width of the dense SwiGLU MLP
    # tokens of the vocabulary (padded to make_vocab_size_divisible_by x TP inside)
    vocab_size: Optional[int] = bounded(None, ge=1)
    # the longest sequence (prompt + response) the model takes
    max_position_embeddings: Optional[int] = bounded(None, ge=1)
    head_dim: Optional[int] = bounded(None, ge=1)  # None: hidden_size / num_attention_heads
    qkv_bias: bool = False  # biases on the query, key and value projections (not the output)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys, before RoPE
    tie_word_embeddings: bool = False  # the LM head is the input embedding
    sliding_window: Optional[int] = bounded(None, ge=1)  # each token attends to itself and the window - 1 before it
    rotary_base: float = bounded(10000.0, gt=0)  # RoPE's theta
    # RoPE frequency scaling: "linear" divides every frequency by the factor; "llama3" (Llama 3.1)
    # divides the low frequencies, keeps the high ones and interpolates between, from the wavelength
    # bounds original_max_position_embeddings / {low,high}_freq_factor; "yarn" (Qwen2.5, Qwen3 past
    # their original window) divides the frequencies that turn fewer than beta_slow times in the
    # original window, keeps those that turn more than beta_fast times, ramps between, and scales the
    # attention's cosines and sines by 0.1 ln(factor) + 1 (or mscale's ratio).
    rope_scaling: Literal["none", "linear", "llama3", "yarn"] = "none"
    rope_scaling_factor: float = bounded(1.0, gt=0)  # linear, llama3 and yarn scaling: the factor
    rope_low_freq_factor: float = bounded(1.0, gt=0)  # llama3 scaling: the low-frequency wavelength bound's factor
    rope_high_freq_factor: float = bounded(4.0, gt=0)  # llama3 scaling: the high-frequency wavelength bound's factor
    # llama3 and yarn scaling: the context the model was trained at
    rope_original_max_position_embeddings: Optional[int] = bounded(None, ge=1)
    rope_beta_fast: float = bounded(32.0, gt=0)  # yarn: rotations in the original window above which a frequency is kept
    rope_beta_slow: float = bounded(1.0, gt=0)  # yarn: rotations below which it is divided by the factor
    # yarn: the attention factor is mscale's over mscale_all_dim's when both are set (DeepSeek's), else of the factor alone
    rope_mscale: Optional[float] = bounded(None, gt=0)
    rope_mscale_all_dim: Optional[float] = bounded(None, gt=0)  # yarn: the denominator's mscale (with rope_mscale)
    rope_truncate: bool = True  # yarn: the ramp's bounds rounded to whole dimensions
    norm_epsilon: float = bounded(1e-5, gt=0)  # RMSNorm's epsilon
    # Mixture of experts: num_experts SwiGLU experts of width moe_ffn_hidden_size, each token sent
    # to moe_router_topk of them by a softmax router (None: the dense MLP in every layer). Layer i
    # has experts when (i + 1) % moe_layer_step == 0 and i is not in moe_dense_layers (Qwen3-MoE's
    # decoder_sparse_step and mlp_only_layers); the others keep the dense MLP of ffn_hidden_size.
    num_experts: Optional[int] = bounded(None, ge=1)
    moe_ffn_hidden_size: Optional[int] = bounded(None, ge=1)  # width of each expert's SwiGLU MLP
    moe_router_topk: int = bounded(2, ge=1)  # experts each token is sent to
    moe_norm_topk_prob: bool = True  # the chosen experts' probabilities rescaled to sum to 1
    moe_layer_step: int = bounded(1, ge=1)  # every n-th layer has experts
    # layers that keep the dense MLP although the step gives them experts
    moe_dense_layers: List[int] = dataclasses.field(default_factory=list)
    # A shared expert beside the routed ones in every layer with experts (Qwen2-MoE): an MLP of this
    # width that sees every token, its output scaled by a sigmoid gate; None: none.
    moe_shared_expert_ffn_hidden_size: Optional[int] = bounded(None, ge=1)
    # Training only (the forward is the same): megatron's load-balancing and router z-losses.
    moe_aux_loss_coeff: float = bounded(0.0, ge=0)
    moe_z_loss_coeff: float = bounded(0.0, ge=0)  # megatron's router z-loss (training only)
    init_method_std: float = bounded(0.02, gt=0)  # std of the random initialisation (a model with no load)
    # the vocabulary is padded to a multiple of this x TP (Megatron's)
    make_vocab_size_divisible_by: int = bounded(128, ge=1)

    @property
    def kv_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def network(self) -> "ModelArchConfig":
        """This architecture without its training-only keys: roles with equal networks compute alike
        and can share weights."""
        return dataclasses.replace(self, **{k: 0.0 for k in TRAINING_ONLY_ARCH_FIELDS})

    def moe_layers(self) -> List[int]:
        """1 for each layer with experts, 0 for a dense one (megatron's ``moe_layer_freq`` list)."""
        if not self.num_experts:
            return [0] * self.num_layers
        return [int((i + 1) % self.moe_layer_step == 0 and i not in self.moe_dense_layers) for i in range(self.num_layers)]

    def tied_output(self, head: str) -> bool:
        """Whether the output layer is the input embedding (an LM head of a tied model; a score
        head is always a separate matrix)."""
        return self.tie_word_embeddings and head == "lm"

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocabulary rounded up so that every TP shard has the same, aligned size (as Megatron)."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple


@dataclasses.dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = bounded(1, ge=1)  # TP: each layer's matrices split over this many ranks
    pipeline_model_parallel_size: int = bounded(1, ge=1)  # PP: the layers split into this many stages
    sequence_parallel: bool = False  # megatron's sequence parallelism over the TP ranks (TP > 1)
    # Experts split over EP ranks taken from the data-parallel ranks (megatron's rule: EP divides
    # DP); each expert is split over the TP ranks as a dense MLP is.
    expert_model_parallel_size: int = bounded(1, ge=1)
    # CP: each sequence divided over this many ranks (2 x CP chunks, chunk r and 2CP-1-r on rank r;
    # models/context_parallel.py); the rows are cut over DP = world / (TP x PP x CP).
    context_parallel_size: int = bounded(1, ge=1)

    def replica_ranks(self) -> int:
        """The ranks one copy of a micro-batch's rows runs on: TP x PP x CP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


@dataclasses.dataclass
class RoleLayoutConfig:
    """A serving role's own layout (policy, reference, reward, value); DP follows from the world
    size (experts split over EP of its DP ranks). None: the run's (``parallel.*``). Trained roles
    always run at the run's layout."""

    # the role's own TP; None: parallel.tensor_model_parallel_size
    tensor_model_parallel_size: Optional[int] = bounded(None, ge=1)
    # the role's own PP; None: parallel.pipeline_model_parallel_size
    pipeline_model_parallel_size: Optional[int] = bounded(None, ge=1)
    expert_model_parallel_size: Optional[int] = bounded(None, ge=1)  # a model with experts


@dataclasses.dataclass
class LoRAConfig:
    """LoRA adapters (models/lora.py) on a trained role's linears: the base frozen, only the
    adapters trained (megatron DDP, the optimizer and EMS hold only them). ``rank`` 0: off. The
    serving role runs the same adapters (the policy ppo_policy's); with them on ppo_policy, the
    reference is the base: it shares ppo_policy's base weights and has none of its own."""

    rank: int = bounded(0, ge=0)  # the adapters' rank; 0: off (the whole network trains)
    alpha: float = bounded(16.0, gt=0)  # the adapters' scale is alpha / rank
    # the linears that get adapters: linear_qkv, linear_proj, linear_fc1, linear_fc2
    target_modules: List[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    # Accepted only to be refused with the reason: rollout and training must score alike.
    dropout: float = bounded(0.0, ge=0, lt=1)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def meta(self) -> Optional[Dict]:
        """What a checkpoint's megatron_rlhf_model.json says of the adapters beside its base (None: off)."""
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)} if self.enabled else None


# The per-kind EMS switches of a role (RoleConfig fields; EMSSwitches carries the same names).
EMS_SWITCHES = ("offload_weights", "free_grad_buffers", "offload_optimizer_state")
# The role keys only a trained role reads (its optimizer, gradients and backward): set on a role the
# stage does not train they would do nothing, so validation refuses them by name (its LoRA too).
TRAINED_ROLE_KEYS = ("global_batch_size", "use_distributed_optimizer", "overlap_grad_reduce", "lr", "min_lr",
                     "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "recompute_activations",
                     "nccl_ub", "overlap_param_gather", "free_grad_buffers", "offload_optimizer_state")


@dataclasses.dataclass
class RoleConfig:
    """One RLHF role. Keys may come from the role's entry in the top file or from the file named
    by ``model_config_file`` (the top file's entry wins)."""

    # a YAML file with more of this role's keys (its model: ...), relative to this file
    model_config_file: Optional[str] = None
    model: ModelArchConfig = dataclasses.field(default_factory=ModelArchConfig)  # the role's network (ModelArchConfig)
    # the role's weights and compute: fp32, or bf16 (with fp32 main weights when trained)
    precision: Literal["fp32", "bf16"] = "bf16"
    load: Optional[str] = None  # checkpoint directory to load weights from
    # A PEFT adapter directory to start the LoRA adapters from (a trained policy with lora: RL's
    # ppo_policy, SFT's and DPO's policy; checkpoint/peft.py).
    load_lora: Optional[str] = None
    # a serving role's own layout (RoleLayoutConfig)
    parallel: RoleLayoutConfig = dataclasses.field(default_factory=RoleLayoutConfig)
    # EMS: ``free_memory`` turns on every switch that applies to the role; each switch can also be
    # set on its own (None: follow free_memory). ``auto``: at start-up, the fewest switches that make
    # the planner's peak fit the device's free memory (memory/auto.py).
    free_memory: Union[bool, Literal["auto"]] = False
    # EMS: the weights go to host memory while the role is idle; None: free_memory
    offload_weights: Optional[bool] = None
    # EMS: the gradient buffers are freed while the role is idle; None: free_memory
    free_grad_buffers: Optional[bool] = None
    # EMS: main weights and Adam moments go to host memory while idle; None: free_memory
    offload_optimizer_state: Optional[bool] = None
    # torch.cuda.empty_cache() where this role's offload freed memory (on CPU glibc's trim, where it
    # freed at least 32 MiB: smaller storages cost more to trim than they give back)
    empty_cache: bool = True
    # Rows per micro-batch, or ``auto``: micro-batches packed by tokens, each at most
    # ``max_tokens_per_micro_batch`` (rows x the longest row's tokens; verl's dynamic batch size).
    micro_batch_size: Union[int, Literal["auto"]] = bounded(1, ge=1)
    # micro_batch_size auto: the tokens of a micro-batch at most (with pack_rows its rows' real tokens)
    max_tokens_per_micro_batch: Optional[int] = bounded(None, ge=2)
    # A micro-batch's rows laid end to end without their padding for the model's passes (verl's
    # use_remove_padding, NeMo-RL's sequence packing): attention within each row, positions
    # restarting per row; the numbers are the padded rows' (fp32: within 1e-6).
    pack_rows: bool = False
    global_batch_size: Optional[int] = bounded(None, ge=1)  # trainable roles: samples per optimizer step
    # Trainable roles only.
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False  # megatron DDP's gradient reduction overlapped with the backward
    lr: float = bounded(1e-6, ge=0)  # the learning rate, constant over the run (no schedule)
    min_lr: float = bounded(0.0, ge=0)  # refused unless 0: there is no schedule to decay to it
    weight_decay: float = bounded(0.0, ge=0)  # AdamW's decoupled weight decay
    adam_beta1: float = bounded(0.9, ge=0, lt=1)  # Adam's beta1
    adam_beta2: float = bounded(0.95, ge=0, lt=1)  # Adam's beta2
    adam_eps: float = bounded(1e-8, gt=0)  # Adam's epsilon
    clip_grad: float = bounded(1.0, ge=0)  # the gradients' global norm is clipped to this (0: off)
    recompute_activations: bool = False  # megatron's full activation recompute: less memory, one more forward
    # An LM head's log-probs and entropy (and their backward) computed this many tokens at a time, so
    # that no more than one chunk's fp32 [tokens, vocabulary/TP] logits is held (0: whole logits, as
    # the batch-invariant mode always computes them). The numbers are the same (fp32: within 1e-7).
    logprob_chunk_tokens: int = bounded(1024, ge=0)
    # The core attention where transformer-engine is absent (models/attention.py): fused (torch's
    # scaled_dot_product_attention: causal without a mask, flash or memory-efficient kernels, no
    # s x s scores kept) or local (megatron's own: an explicit mask and the s x s scores in memory).
    attention: Literal["fused", "local"] = "fused"
    # megatron settings that keep device addresses fixed for the life of the run; EMS re-allocates
    # storages on every onload, so they are refused while the role's state moves (validation.py).
    cuda_graph_impl: Literal["none", "local", "transformer_engine"] = "none"  # CUDA graphs capture addresses
    nccl_ub: bool = False  # trainable roles: NCCL user buffers register DDP's buffers once
    # Trainable roles: megatron defers the all-gather of updated weights to the role's next forward;
    # the serving role reads those weights first. Accepted only to be refused with the reason.
    overlap_param_gather: bool = False
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)  # trained roles only

    @property
    def token_budget(self) -> Optional[int]:
        """The tokens per micro-batch under ``micro_batch_size: auto``, else None (rows)."""
        return self.max_tokens_per_micro_batch if self.micro_batch_size == "auto" else None

    def ems_switch(self, name: str, auto: Optional[bool] = None) -> bool:
        """An EMS switch (offload_weights, free_grad_buffers, offload_optimizer_state) as it
        applies: its own value when set, else ``free_memory``; under ``free_memory: auto`` before
        the choice is made, ``auto`` (planning: what to assume) or an error."""
        value = getattr(self, name)
        if value is None and self.free_memory == "auto":
            if auto is not None:
                return auto
            raise RuntimeError(f"free_memory: auto is chosen at start-up (memory.auto.choose_free_memory); {name} "
                               "was asked before")
        return self.free_memory if value is None else value


@dataclasses.dataclass
class RewardRoleConfig(RoleConfig):
    """The reward role: a scalar-head model scoring the last response token (``type: model``), or
    rule functions (``type: function``): ``function: module:callable`` (or ``path/to/file.py:callable``,
    relative to the file that names it), or several as ``functions: {spec: weight, ...}`` whose
    weighted sum is the score. Each is called per response as ``fn(prompts, responses, **fields)``
    with one-element lists (rewards/contract.py) in a pool of worker processes (rewards/pool.py)."""

    # model: a scalar-head reward model; function: rule functions in worker processes; judge: no
    # reward of its own, the judge's verdicts alone (judge.enabled; an environment's rewards added)
    type: Literal["model", "function", "judge"] = "model"
    function: Optional[str] = None  # type function: module:callable or path/to/file.py:callable
    functions: Optional[Dict[str, float]] = None  # type function: {spec: weight, ...}; the score is their weighted sum
    # A score beyond +-max_abs_score stops the run (naming the prompt): a reward that large breaks
    # the losses long before it is infinite.
    max_abs_score: float = bounded(1.0e4, gt=0)
    # A call that raises or takes longer than timeout_s scores failure_score and is counted
    # (reward/failures, reward/timeouts); the worker of a call that timed out is replaced.
    timeout_s: float = bounded(30.0, gt=0)
    failure_score: float = 0.0  # the score of a call that raised or timed out (counted in reward/failures)
    num_workers: int = bounded(2, ge=1)  # worker processes per rank
    # type: model: each score as (score - mean) / std, the mean and std its checkpoint records (a reward
    # model of stage rm, from its held-out pairs; OpenRLHF's normalize_reward). Unlike ppo.normalize_reward,
    # fixed for the run and centred.
    normalize: bool = False
    # type: model: a process reward model (stage prm): the response's steps end at each of this text
    # (and at the response's end), and each step scores sigmoid(the model's score at its last token),
    # the probability that it is right. None: an outcome reward model (the last token's score).
    step_separator: Optional[str] = None
    # step_separator: the response's score is the min, last or mean of its step scores; token: each step
    # score is a reward at its step's last token (PPO's GAE and REINFORCE++ read per-token rewards)
    step_aggregation: Literal[STEP_AGGREGATIONS] = "min"


@dataclasses.dataclass
class JudgeRoleConfig(RoleConfig):
    """An LLM judge (rollout/judging.py): a generative model that reads each response in ``template``
    (its prompt and the row's reference filled in) and writes a verdict, which ``parser`` turns into
    a score; ``weight`` times the score is added to the reward's. It runs in a phase of its own after
    the rollout is scored (the policy off the device, the judge on it), on the run's tokenizer."""

    enabled: bool = False  # build the judge and add its scores (RL only)
    weight: float = 1.0  # its score's weight in each response's reward (beside the reward's own)
    # The judge's prompt: text with {prompt}, {response} and {reference} (the row's reference_key
    # column), sent as one user message under data.apply_chat_template; or the file holding it
    # (relative to the config file). Other braces are kept as written.
    template: Optional[str] = None
    template_file: Optional[str] = None  # a file holding the template (instead of ``template``)
    # Or the judge's prompt as chat messages ({role, content}), each content a template as above,
    # through the tokenizer's chat template (data.apply_chat_template), generation prompt added.
    messages: Optional[List[Dict[str, str]]] = None
    reference_key: str = "ground_truth"  # the data column {reference} reads (a reference answer or response)
    # number: the verdict's first number; boxed: the number in its last \boxed{}; choice: the first of
    # ``choices``' words it says (A/B against a reference response), scored as ``choices`` says;
    # function: parser_function's score
    parser: Literal[JUDGE_PARSERS] = "number"
    # number, boxed: [low, high]; a number outside is unparsed
    score_range: List[float] = dataclasses.field(default_factory=lambda: [0.0, 10.0])
    choices: Dict[str, float] = dataclasses.field(default_factory=dict)  # choice: word -> score
    # parser function: module:callable or file.py:callable, a reward function (rewards/contract.py) in the
    # reward pool's workers (reward.num_workers, reward.timeout_s), called with the verdicts as its
    # responses and the judged response as the field judged_response; NaN for a verdict it cannot read
    # (unparsed); a call that raises or times out scores unparsed_score, counted (judge/failures).
    parser_function: Optional[str] = None
    # Verdicts per response: 1 is greedy; more are sampled at ``temperature`` and combined by ``combine``.
    samples: int = bounded(1, ge=1)
    combine: Literal[JUDGE_COMBINES] = "mean"  # samples > 1: mean, majority (ties: the lower), min or max
    temperature: float = bounded(1.0, gt=0)  # samples > 1: the verdicts' sampling temperature
    max_new_tokens: int = bounded(16, ge=1)  # a verdict's tokens at most
    # The judge's prompt tokens at most (the KV cache's length with max_new_tokens); a longer one is
    # not judged: it scores unparsed_score and is counted (judge/too_long).
    max_prompt_length: int = bounded(512, ge=1)
    unparsed_score: float = 0.0  # the score of a verdict the parser cannot read (counted: judge/unparsed)


@dataclasses.dataclass
class TokenizerConfig:
    """``char``: the built-in character tokenizer (ids: pad 0, bos 1, eos 2, then ``alphabet``);
    ``hf``: a Hugging Face tokenizer at ``path`` (relative to the config file): a model directory,
    whose special tokens, chat template and end tokens (generation_config.json's too) come from its
    own files, or a bare tokenizer.json (which names none: set eos_token)."""

    type: Literal["char", "hf"] = "char"  # char: the built-in character tokenizer; hf: a Hugging Face tokenizer at path
    path: Optional[str] = None  # hf: a model directory or a tokenizer.json, relative to the config file
    alphabet: Optional[str] = None  # char only; None: printable ASCII
    eos_token: Optional[str] = None  # hf: one more token that ends a response
    # hf: more tokens that end a response (Qwen's <|endoftext|> and <|im_end|>, Llama-3's <|eot_id|>
    # and <|eom_id|>); the end tokens are these, eos_token, the tokenizer's and generation_config.json's.
    eos_tokens: List[str] = dataclasses.field(default_factory=list)
    pad_token: Optional[str] = None  # hf: None: the tokenizer's own, else its first end token


@dataclasses.dataclass
class DataConfig:
    # JSONL (one object per line) or Parquet; relative to the config file.
    prompt_file: Optional[str] = None
    val_file: Optional[str] = None  # validation prompts (trainer.val_interval), same format
    # The stages before RL: their training rows (sft: chats or prompt/completion; rm, dpo: preference
    # pairs, data/preferences.py); data.val_file holds their validation rows, in the same format.
    train_file: Optional[str] = None
    # The column that holds the prompt: a string, or a chat (a list of {"role", "content"}
    # messages). None: "prompt" or "messages", whichever the rows have. Every other column travels
    # with the row to the reward function (ground_truth, data_source, extra_info, ...).
    prompt_key: Optional[str] = None
    apply_chat_template: bool = False  # the tokenizer's chat template, generation prompt added
    system_prompt: Optional[str] = None  # with the template: a system message first, unless the row has one
    max_prompt_length: int = bounded(128, ge=1)  # tokens
    # A longer prompt: "filter" skips it (counted and reported), "truncate" keeps its last tokens.
    overlong_prompts: Literal["filter", "truncate"] = "filter"
    shuffle: bool = True  # reshuffled every pass over the data, from the run's seed
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)  # the tokenizer (TokenizerConfig)


@dataclasses.dataclass
class GenerationConfig:
    # tokens a response may have (a turn's, multi-turn, unless max_tokens_per_turn)
    max_new_tokens: int = bounded(128, ge=1)
    greedy: bool = False  # argmax decoding instead of sampling (every response to a prompt then alike)
    temperature: float = bounded(1.0, gt=0)  # also applied to every log-prob PPO computes, so ratios match sampling
    top_k: int = bounded(0, ge=0)  # 0: off
    top_p: float = bounded(1.0, gt=0, le=1)  # 1.0: off
    # Rows decoded at once per DP rank (the KV cache's size); None: the whole rollout; auto: the
    # most the device memory free at start-up holds beside the roles' resident state (the planner's
    # peak with the cache fits; at most the whole rollout), said at start-up and in the dry run.
    batch_size: Union[int, Literal["auto"], None] = bounded(None, ge=1)
    # Responses per prompt (a group): kept together on one DP rank, each sampled independently.
    samples_per_prompt: int = bounded(1, ge=1)
    # Every response max_new_tokens long: an end token is sampled as any other and ends nothing (vLLM's
    # and verl's ignore_eos; for benchmarks and long-sequence checks, single-turn rollouts only).
    ignore_eos: bool = False

    def slots(self, rows: int) -> int:
        """Rows decoded at once out of ``rows``: batch_size, or every row (None; auto until start-up
        has chosen it, memory/auto.resolve_decode_slots: planning then counts every row)."""
        return rows if self.batch_size in (None, "auto") else min(rows, self.batch_size)


@dataclasses.dataclass
class PartialRolloutConfig:
    """Partial rollouts (slime's APRIL, verl's colocate_async; rollout/partial.py): responses to
    ``over_sample`` x ppo.rollout_batch_size prompts are in flight; generation stops once
    rollout_batch_size groups (every response of a prompt) have ended, and the unfinished ones are
    held with the run's state and resumed first by the next iteration's weights. A group whose first
    tokens are more than ``max_staleness`` weight versions older than the update is dropped (counted)."""

    enabled: bool = False  # partial rollouts on (single-turn, or trajectories with an environment)
    over_sample: float = bounded(2.0, ge=1)  # prompts in flight per iteration, as a multiple of ppo.rollout_batch_size
    # weight versions a held group's first tokens may lag the update; older: dropped
    max_staleness: int = bounded(2, ge=0)
    # Tokens each response generates between the checks for ended groups (each check ends a
    # generate() call: finer stops cost more calls); None: max_new_tokens / 4.
    chunk_tokens: Optional[int] = bounded(None, ge=1)
    # With an environment (rollout/partial_turns.py): turns each trajectory takes between the
    # checks (a held trajectory waits at a turn's start); None: 1.
    chunk_turns: Optional[int] = bounded(None, ge=1)

    def chunk(self, generation: "GenerationConfig") -> int:
        return self.chunk_tokens or max(1, generation.max_new_tokens // 4)

    def turns_per_chunk(self) -> int:
        return self.chunk_turns or 1

    def pool_groups(self, rollout_batch_size: int) -> int:
        """Prompts in flight (held and new) each round."""
        return math.ceil(self.over_sample * rollout_batch_size - 1e-9)


@dataclasses.dataclass
class SandboxConfig:
    """Where and within what the Python tool (``megatron_rlhf.agents.sandbox:python``, or a tool of
    yours calling ``run_python``) runs model-written code; megatron_rlhf/agents/sandbox. The limits bind every
    kind that can set them (remote: the service's own, but for the wall time and output)."""

    # isolated: a fresh interpreter in namespaces of its own made by bubblewrap (no host file but the
    # interpreter's, a tmpfs as its directory, no network, an unprivileged user, seccomp); remote: a
    # SandboxFusion service (url); unsafe_process: a plain process under an audit hook (no isolation).
    kind: Literal[SANDBOX_KINDS] = "isolated"
    url: Optional[str] = None  # remote: the service's base URL (http://host:8080); POST {url}/run_code
    max_concurrent_calls: int = bounded(8, ge=1)  # remote: calls in flight per environment worker
    retries: int = bounded(2, ge=0)  # remote: tries again after a connection error, then answers the error
    cpu_s: float = bounded(10.0, gt=0)  # CPU seconds per call
    # wall-clock seconds per call; at least a second below rollout.tool_timeout_s, so that the model
    # reads the sandbox's own stop (what the code printed, then why) rather than the tool's time-out
    wall_s: float = bounded(15.0, gt=0)
    memory_mb: int = bounded(1024, ge=16)  # address space of the code's process (its threads' 2 MB stacks included)
    disk_mb: int = bounded(64, ge=1)  # isolated: the bytes of its working directory (a tmpfs), all files together
    inodes: int = bounded(4096, ge=16)  # isolated: files and directories in its working directory
    file_mb: int = bounded(16, ge=1)  # the largest file it may write
    threads: int = bounded(64, ge=1)  # isolated: threads of its process (it may start no other process)
    # Descriptors it may hold at once (files, pipes, sockets: their kernel buffers, up to about 1 MB
    # each, are memory its address-space limit does not count).
    open_files: int = bounded(64, ge=16)
    output_bytes: int = bounded(8192, ge=64)  # standard output and error together, cut beyond

    @property
    def remote(self) -> bool:
        return self.kind == "remote"

    @property
    def unsafe(self) -> bool:
        """Whether code runs without isolation (said at start-up, counted)."""
        return self.kind == "unsafe_process"


@dataclasses.dataclass
class RolloutConfig:
    """Multi-turn rollouts: with ``environment`` (``module:Class`` or ``file.py:Class``, relative
    to the config file; agents/protocol.py) the policy writes a turn, the environment answers,
    the policy writes again, until the environment says done or a limit is reached; only the
    policy's tokens are trained (the loss mask). None: one response per sample."""

    environment: Optional[str] = None  # module:Class or file.py:Class of a custom environment (agents/protocol.py)
    max_turns: int = bounded(4, ge=1)  # the model's turns per trajectory at most
    max_tokens_per_turn: Optional[int] = bounded(None, ge=1)  # None: generation.max_new_tokens
    # Prompt, turns and replies together; None: max_prompt_length + max_turns x (turn + observation).
    max_trajectory_tokens: Optional[int] = bounded(None, ge=2)
    max_observation_tokens: int = bounded(256, ge=1)  # longer replies lose their middle (counted)
    # Strings that end a turn besides the end tokens (a tool call's closing tag).
    stop: List[str] = dataclasses.field(default_factory=list)
    env_timeout_s: float = bounded(30.0, gt=0)  # per environment call
    env_workers: int = bounded(2, ge=1)  # worker processes per policy replica
    # An environment worker resident beyond this after an answer fails that call (counted in
    # rollout/env_failures) and is replaced: an environment that keeps growing cannot take the host's memory.
    env_memory_mb: int = bounded(4096, ge=64)
    # A trajectory goes to its environment as its turn ends, and its next turn joins the running
    # batch when the reply comes; False: lockstep (every trajectory's turn, then every call).
    overlap_turns: bool = True
    # Tools (megatron_rlhf/agents): callables (module:callable or file.py:callable) the built-in tool
    # environment calls for the model; their schemas go to the chat template's tools.
    tools: List[str] = dataclasses.field(default_factory=list)
    # MCP servers whose tools the model may call too: command lines (stdio), run in the config's directory.
    mcp_servers: List[str] = dataclasses.field(default_factory=list)
    tool_parser: Literal[TOOL_PARSERS] = "hermes"  # the models' call format (agents/parsers.py)
    max_parallel_calls: int = bounded(4, ge=1)  # calls of one turn run side by side, at most this many
    tool_timeout_s: float = bounded(20.0, gt=0)  # per call; below env_timeout_s
    # where the Python tool runs model-written code (SandboxConfig)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    # partial rollouts (PartialRolloutConfig)
    partial: PartialRolloutConfig = dataclasses.field(default_factory=PartialRolloutConfig)

    @property
    def uses_tools(self) -> bool:
        """Whether the built-in tool environment runs (tools or MCP servers named)."""
        return bool(self.tools or self.mcp_servers)

    @property
    def multi_turn(self) -> bool:
        """Whether an environment (a custom one, or the tool environment) answers between turns."""
        return bool(self.environment or self.uses_tools)

    def turn_tokens(self, generation: "GenerationConfig") -> int:
        return self.max_tokens_per_turn or generation.max_new_tokens

    def trajectory_tokens(self, data: "DataConfig", generation: "GenerationConfig") -> int:
        if self.max_trajectory_tokens is not None:
            return self.max_trajectory_tokens
        return data.max_prompt_length + self.max_turns * (self.turn_tokens(generation) + self.max_observation_tokens)


@dataclasses.dataclass
class PPOConfig:
    iterations: int = bounded(100, ge=1)  # RL iterations (rollout, scoring, update) of the run
    rollout_batch_size: int = bounded(64, ge=1)  # prompts per iteration, over all data-parallel ranks
    ppo_epochs: int = bounded(1, ge=1)  # passes over each rollout; each pass has rollout/global_batch_size steps
    clip_ratio: float = bounded(0.2, ge=0)  # PPO's ratio clip on both sides unless clip_ratio_low / clip_ratio_high
    # The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; None: clip_ratio (DAPO's
    # "clip-higher" sets clip_ratio_high above clip_ratio_low).
    clip_ratio_low: Optional[float] = bounded(None, ge=0)
    clip_ratio_high: Optional[float] = bounded(None, ge=0)  # the upper clip (see clip_ratio_low)
    value_clip: Optional[float] = bounded(0.2, gt=0)  # gae: the value loss's clip around the old values; None: no clip
    kl_coef: float = bounded(0.05, ge=0)  # the KL penalty's weight (towards the reference); 0: no reference pass
    # k1: log p - log q; k3: (q/p - 1) - log(q/p); low_var_kl: k3 clamped to [-10, 10].
    kl_estimator: Literal[KL_ESTIMATORS] = "k1"
    # False: the KL penalty is part of every token's reward (classic RLHF PPO); True: it is a term
    # of the policy loss, kl_coef * KL(policy || reference) per token (the GRPO way), not a reward.
    kl_in_loss: bool = False
    adaptive_kl: bool = False  # Ziegler et al.: steer kl_coef towards kl_target
    kl_target: float = bounded(6.0, gt=0)  # adaptive_kl: the KL per sequence kl_coef steers to
    kl_horizon: int = bounded(10000, ge=1)  # adaptive_kl: the steering's horizon in samples
    gamma: float = bounded(1.0, ge=0, le=1)  # the discount of GAE and REINFORCE++ returns
    lam: float = bounded(0.95, ge=0, le=1)  # gae: GAE's lambda
    # scores clipped to +-this before the KL penalty is added; None: off
    reward_clip: Optional[float] = bounded(None, gt=0)
    normalize_reward: bool = False  # divide scores by the running std of every score seen
    whiten_advantages: bool = True  # over the whole rollout (every DP rank's share together)
    # How per-token losses make a step's loss; the same over any micro-batch size, DP or PP layout:
    # token-mean (every response token of the global batch weighs the same), seq-mean-token-sum,
    # seq-mean-token-mean (each sequence weighs the same), seq-mean-token-sum-norm (Dr. GRPO: each
    # sequence's token sum over the response budget, a constant).
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"
    # vanilla: PPO's per-token ratio; gspo: the sequence's ratio (mean log-ratio over its tokens),
    # with seq-mean-token-mean and small clip ranges (the paper's 3e-4 / 4e-4).
    policy_loss: Literal[POLICY_LOSSES] = "vanilla"
    # Dual-clip PPO: where the advantage is negative the loss is at most -advantage * clip_ratio_c
    # (> 1). None: off (verl defaults to 3.0).
    clip_ratio_c: Optional[float] = bounded(None, gt=1)

    @property
    def clip_range(self) -> "tuple[float, float]":
        """(low, high): the policy ratio is clipped to [1 - low, 1 + high]."""
        low, high = self.clip_ratio_low, self.clip_ratio_high
        return (self.clip_ratio if low is None else low, self.clip_ratio if high is None else high)


@dataclasses.dataclass
class RolloutCorrectionConfig:
    """Off-policy correction of the rollout (ppo/correction.py): the tokens were sampled by a
    behaviour policy (older weights with partial rollouts; the engine's numerics on GPU) whose
    log-probs the engine records; the update weighs each token by pi_old / pi_behaviour.
    ``truncate``: by min(ratio, threshold) (truncated importance sampling, TIS); ``mask``: tokens
    whose ratio leaves [threshold_low, threshold] leave the policy loss. ``level``: the ratio of
    each token, or of each sequence (the product over its tokens, every token of it alike)."""

    # off; truncate: weigh tokens by min(ratio, threshold) (TIS); mask: drop tokens outside the band
    mode: Literal[ROLLOUT_CORRECTIONS] = "off"
    # token: each token's ratio; sequence: the product over the sequence's tokens
    level: Literal[CORRECTION_LEVELS] = "token"
    threshold: float = bounded(2.0, gt=0)  # truncate: the cap; mask: the band's top
    threshold_low: Optional[float] = bounded(None, ge=0)  # mask only; None: 1 / threshold

    @property
    def band(self):
        """(low, high) of the ratio kept (mask) or the cap (truncate: high)."""
        low = self.threshold_low if self.threshold_low is not None else 1.0 / self.threshold
        return low, self.threshold


@dataclasses.dataclass
class AlgorithmConfig:
    """How advantages are estimated and which rollouts are kept. ``gae`` is PPO with a critic
    (value and ppo_value roles); every other estimator is critic-free and builds neither.

    grpo: (score - group mean) / (group std + eps) within each prompt's group of responses
      (``norm_adv_by_std_in_grpo: false``: no std division, as Dr. GRPO).
    rloo: score - the mean score of the other responses to the same prompt.
    reinforce_plus_plus: discounted returns of the per-token rewards, whitened over the rollout.
    reinforce_plus_plus_baseline: score - group mean at every token, whitened over the rollout.
    A group of one has no baseline: its advantage is its score (whitened for REINFORCE++)."""

    # gae (PPO with a critic), grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline
    advantage_estimator: Literal[ADVANTAGE_ESTIMATORS] = "gae"
    norm_adv_by_std_in_grpo: bool = True  # grpo: divide by the group's std (false: Dr. GRPO)
    # DAPO's dynamic sampling: groups whose scores are all equal teach nothing; drop them and
    # generate more groups, at most ``dynamic_sampling_extra_rounds`` more rollouts' worth.
    dynamic_sampling: bool = False
    dynamic_sampling_extra_rounds: int = bounded(2, ge=0)  # dynamic_sampling: extra rollouts' worth of groups at most
    # DAPO's overlong reward shaping: a response longer than max_new_tokens - overlong_buffer_length
    # loses overlong_penalty_factor * (excess / overlong_buffer_length) of score (0: off).
    overlong_buffer_length: int = bounded(0, ge=0)
    # the penalty at overlong_buffer_length tokens beyond the soft limit
    overlong_penalty_factor: float = bounded(1.0, ge=0)
    # off-policy correction of the rollout (RolloutCorrectionConfig)
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)


@dataclasses.dataclass
class MoEConfig:
    """Mixtures of experts. ``routing_replay``: route each token, in every later forward of its
    sample (the old log-probs, every training step), to the experts it was sent to when the record
    was taken: ``rollout`` (by generation: the ratio compares the experts that sampled the token) or
    ``old_logprob`` (by the old-log-prob pass); ``off``: every forward routes afresh (models/routing.py)."""

    routing_replay: Literal["off", "rollout", "old_logprob"] = "off"  # off, rollout or old_logprob (see the section)


@dataclasses.dataclass
class TrainerConfig:
    output_dir: str = "outputs/ppo"  # --output-dir wins; relative to the working directory
    tensorboard: bool = True  # events in <output_dir>/tensorboard
    # Weights & Biases beside TensorBoard (pip install -e .[wandb]); WANDB_MODE=offline logs
    # without a network, into <output_dir>/wandb.
    wandb: bool = False
    wandb_project: str = "megatron-rlhf"  # the W&B project
    wandb_run_name: Optional[str] = None  # the W&B run's name; None: W&B's own
    progress_bar: bool = True  # a tqdm bar on rank 0 (off when not a terminal)
    save_interval: int = bounded(0, ge=0)  # PPO checkpoint every N iterations (0: only at the end)
    save_at_end: bool = True  # a checkpoint after the last iteration or step
    # Write PPO checkpoints in a background thread from host copies taken at the save (training
    # goes on; latest moves once every rank has written; checkpoint/background.py).
    async_save: bool = False
    resume: Literal["never", "auto"] = "never"  # auto: continue from the output dir's latest checkpoint
    # A NaN or infinite loss or gradient: "stop" the run before the optimizer applies it (the last
    # checkpoint stays the last finite state), or "skip" that optimizer step and count it
    # (metrics <role>/skipped_steps).
    on_non_finite: Literal["stop", "skip"] = "stop"
    # EMS leak guard, after every offload: device bytes left by an offloaded kind, or allocated /
    # reserved device memory grown since the same moment of the first iteration (CUDA): "warn",
    # "error" (stop the run), or "off".
    memory_guard: Literal["off", "warn", "error"] = "warn"
    # Batch-invariant arithmetic (models/batch_invariant.py): a token's numbers do not depend on the
    # rows beside it, and the engine's behaviour log-probs are the trainer's bit for bit (rollout
    # correction reads exactly 1). TP=1, dense models with fused attention, no LoRA, on CPU.
    batch_invariant: bool = False
    # EMS: bring the next role back while the current one computes (a side stream on CUDA), for
    # each pair of phases where the planner says both fit in the device memory free at start-up.
    overlap_onload: bool = False
    # A collective that waits longer than this (a rank that never arrives: a hang, a dead peer)
    # ends the run with one line naming the phase, instead of waiting forever.
    collective_timeout_s: float = bounded(1800.0, gt=0)
    # Validation on data.val_file: every val_interval iterations (0: never) and, with
    # val_before_train, before the first; val_samples_per_prompt responses per prompt (the k of
    # val/pass@k and val/mean@k), greedy or sampled with the generation settings.
    val_interval: int = bounded(0, ge=0)
    val_before_train: bool = False  # validate once before the first iteration
    val_samples_per_prompt: int = bounded(1, ge=1)  # responses per validation prompt (the k of val/pass@k)
    val_greedy: bool = True  # validation decodes greedily (else with the generation settings)


@dataclasses.dataclass
class StageConfig:
    """What the stages before RL share (the ``sft``, ``rm`` and ``dpo`` sections): passes over
    data.train_file in optimizer steps of the trained role's ``global_batch_size`` (rows for SFT,
    preference pairs for RM and DPO; a pair's two sides always share a micro-batch and a DP rank),
    validated on data.val_file every trainer.val_interval steps."""

    epochs: int = bounded(1, ge=1)  # passes over the training rows, each in a new order (data.shuffle)
    max_steps: Optional[int] = bounded(None, ge=1)  # stop after this many optimizer steps; None: every epoch
    # Prompt + response tokens of a row. A longer response is cut to fit (both of a pair alike, each
    # keeping its first tokens); a prompt is never cut: a row whose prompt alone leaves no room is refused.
    max_length: int = bounded(512, ge=2)


@dataclasses.dataclass
class SFTConfig(StageConfig):
    """Supervised fine-tuning of the policy: the next-token loss on the response tokens only (an
    assistant message's tokens of a chat, as the chat template marks them; a ``completion``), a
    mean over every such token of the step."""


@dataclasses.dataclass
class RMConfig(StageConfig):
    """A reward model from preference pairs: the reward role's score of the last token of each
    side, trained with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin), a mean
    over the step's pairs (``margin``: the row's column, 0 without one)."""

    # TRL's: plus this times the mean of (r_chosen + r_rejected)^2, so scores centre on 0. None: off.
    center_rewards_coefficient: Optional[float] = bounded(None, ge=0)


@dataclasses.dataclass
class PRMConfig(StageConfig):
    """A process reward model from stepwise rows (data/steps.py: TRL's prompt, completions and
    labels, or Math-Shepherd's tagged text): the reward role's score at the last token of each step
    (its separator) is the logit that the step is right, trained with the binary cross-entropy, a
    mean over the step's labelled steps; TRL's PRMTrainer with a two-label token classifier (whose
    two logits' difference is this score) is the same loss."""

    step_separator: str = "\n"  # the text after every step (TRL's step_separator); its last token is scored
    train_on_last_step_only: bool = False  # training reads only each row's last label (validation reads all)


@dataclasses.dataclass
class DPOConfig(StageConfig):
    """Direct preference optimisation: the policy against a frozen reference (the policy's
    starting weights unless reference.load says otherwise), on the log-ratio margin
    h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)), each log-prob summed over the
    response's tokens. sigmoid: -log sigmoid(beta h) (with ``label_smoothing`` e: conservative DPO,
    -(1-e) log sigmoid(beta h) - e log sigmoid(-beta h)); ipo: (h / tokens - 1 / (2 beta))^2, each
    side's log-ratio over its own response tokens (TRL's and the IPO authors' normalisation)."""

    beta: float = bounded(0.1, gt=0)  # the DPO temperature: how far from the reference the policy may go
    loss_type: Literal[DPO_LOSSES] = "sigmoid"  # sigmoid (DPO, cDPO with label_smoothing) or ipo
    label_smoothing: float = bounded(0.0, ge=0, lt=0.5)  # sigmoid only
    # The NLL (SFT) term on the chosen responses (RPO; TRL's loss_type [sigmoid, sft] with weights
    # [1, nll_coef]): plus nll_coef times their mean per-token negative log-likelihood. 0: off.
    nll_coef: float = bounded(0.0, ge=0)
    # sigmoid: each side's log-ratio over its own response tokens (TRL's sigmoid_norm).
    length_normalize: bool = False
    # per_step: the reference scores each step's pairs (onloaded by EMS for that, offloaded while the
    # policy trains); precompute: it scores every pair once before training, and is never resident again.
    reference_logps: Literal["per_step", "precompute"] = "per_step"


@dataclasses.dataclass
class RLHFConfig:
    # rl: PPO and its kin (controller.py); sft, rm, dpo: the stages before it (megatron_rlhf/stages); every stage runs run_loop.py.
    stage: Literal[STAGES] = "rl"
    seed: int = 1234  # the run's seed: data order, sampling streams, initialisation
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)  # the run's layout (ParallelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # prompts, rows and the tokenizer (DataConfig)
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)  # sampling (GenerationConfig)
    # multi-turn rollouts, environments and tools (RolloutConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)  # the RL update (PPOConfig)
    # advantage estimation and rollout filtering (AlgorithmConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)  # mixtures of experts (MoEConfig)
    # outputs, checkpoints, validation, faults (TrainerConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    # the serving policy (generation; SFT's and DPO's trained policy)
    policy: RoleConfig = dataclasses.field(default_factory=RoleConfig)
    # the frozen reference of the KL penalty and of DPO
    reference: RoleConfig = dataclasses.field(default_factory=RoleConfig)
    # the reward model or rule functions (RM's trained model)
    reward: RewardRoleConfig = dataclasses.field(default_factory=RewardRoleConfig)
    # an LLM judge whose verdicts add to the reward (JudgeRoleConfig)
    judge: JudgeRoleConfig = dataclasses.field(default_factory=JudgeRoleConfig)
    value: RoleConfig = dataclasses.field(default_factory=RoleConfig)  # gae: the serving critic
    ppo_policy: RoleConfig = dataclasses.field(default_factory=RoleConfig)  # the trained policy of RL
    ppo_value: RoleConfig = dataclasses.field(default_factory=RoleConfig)  # gae: the trained critic
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)  # stage sft (SFTConfig)
    rm: RMConfig = dataclasses.field(default_factory=RMConfig)  # stage rm (RMConfig)
    prm: PRMConfig = dataclasses.field(default_factory=PRMConfig)  # stage prm (PRMConfig)
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)  # stage dpo (DPOConfig)
    # Dotted key -> the file it was read from ("" -> the top file); filled by the loader.
    origin: Dict[str, str] = dataclasses.field(
        default_factory=dict, repr=False, compare=False, metadata={"internal": True}
    )
    # Dotted keys the loader refused (unknown, or of the wrong type: left at their defaults), so
    # that the checks across keys do not report a consequence of the same mistake again.
    refused: List[str] = dataclasses.field(default_factory=list, repr=False, compare=False, metadata={"internal": True})

    def source_of(self, key: str) -> str:
        """The file a dotted key came from (its nearest configured ancestor's, else the top file)."""
        while key and key not in self.origin:
            key = key.rpartition(".")[0]
        return self.origin.get(key, self.origin.get("", "<config>"))

    def logprob_chunk_tokens(self, role: str) -> int:
        """The tokens per chunk of ``role``'s log-probs as its passes compute them (0: whole logits,
        as the batch-invariant mode always does)."""
        return 0 if self.trainer.batch_invariant else self.role(role).logprob_chunk_tokens

    def at(self, key: str) -> str:
        """``file: key`` for messages, naming the environment variable that set it when one did."""
        return located(self.origin.get(key) or self.source_of(key), key)

    def base_dir_of(self, key: str) -> str:
        """The directory a relative path under ``key`` is resolved against: the directory of the
        file that set it, or the working directory where the command line did."""
        source = self.source_of(key)
        return os.getcwd() if source == COMMAND_LINE else os.path.dirname(source)

    def path_of(self, key: str) -> Optional[str]:
        """A path-valued key resolved against base_dir_of(key)."""
        value = self
        for part in key.split("."):
            value = getattr(value, part)
        if value is None or os.path.isabs(value):
            return value
        return os.path.join(self.base_dir_of(key), value)

    @property
    def critic_free(self) -> bool:
        return self.algorithm.advantage_estimator not in CRITIC_ESTIMATORS

    @property
    def roles(self) -> tuple:
        """The roles the run builds: a stage's before RL (STAGE_ROLES); for RL, all six for GAE,
        no value or ppo_value when critic-free."""
        if self.stage != "rl":  # RL's roles follow its estimator (the critic: GAE only)
            return STAGE_ROLES[self.stage]
        return tuple(r for r in ROLE_NAMES if not (self.critic_free and r in CRITIC_ROLES)
                     and not (r == "judge" and not self.judge.enabled))

    @property
    def stage_config(self) -> Optional["StageConfig"]:
        """The section of a stage before RL (sft, rm or dpo); None for RL (it has none)."""
        return getattr(self, self.stage, None)

    @property
    def steps_key(self) -> str:
        """The key that bounds the run's steps (what --iterations sets): RL's iterations, or a
        stage's optimizer steps (its epochs bound them too)."""
        return "ppo.iterations" if self.stage == "rl" else f"{self.stage}.max_steps"

    def unread_settings(self) -> tuple:
        """(sections, keys) the run's stage does not read: for RL the stages' sections and keys
        (STAGE_ONLY_KEYS); for a stage before RL, RL's (RL_ONLY_SECTIONS, RL_ONLY_KEYS), the other
        stages' sections and the roles it does not build. Validation refuses each one set, by name;
        the dry run leaves them out."""
        others = tuple(s for s in STAGES if s not in ("rl", self.stage))
        if self.stage == "rl":  # RL's sections are the schema's own, read
            return others, STAGE_ONLY_KEYS
        return RL_ONLY_SECTIONS + others + tuple(r for r in ROLE_NAMES if r not in self.roles), RL_ONLY_KEYS

    @property
    def phase_order(self) -> tuple:
        """(phase, active role) in the order they run: an RL iteration's (PHASE_ORDER over the roles
        built) or a stage's step (STAGE_PHASES)."""
        phases = {"rl": PHASE_ORDER, **STAGE_PHASES}[self.stage]
        return tuple((phase, role) for phase, role in phases if role in self.model_roles)

    @property
    def rows_per_sample(self) -> int:
        """Sequences a sample is: 2 for a preference pair (its chosen and rejected sides), else 1."""
        return 2 if self.sample_unit == "pairs" else 1

    @property
    def sample_unit(self) -> str:
        """What one sample of the run's data is, in words (SAMPLE_UNITS): prompts, rows or pairs."""
        return SAMPLE_UNITS[self.stage]

    @property
    def model_roles(self) -> tuple:
        """The roles that are networks (those the algorithm runs, but a function reward)."""
        return tuple(r for r in self.roles if not (r == "reward" and self.reward.type != "model"))

    @property
    def successions(self) -> Dict[str, str]:
        """Each role -> the role that always runs right after it within an iteration (PHASE_ORDER
        over the roles built); under dynamic sampling nothing follows the last sampling phase for
        sure (sampling may go round again)."""
        order = [role for _, role in self.phase_order]
        pairs = dict(zip(order, order[1:]))
        if self.algorithm.dynamic_sampling:  # the last phase that scores a round
            pairs.pop(next(r for r in ("judge", "reward", "policy") if r in order), None)
        return pairs

    @property
    def trainable_roles(self) -> tuple:
        """The roles with an optimizer: ppo_policy (and ppo_value) in RL, a stage's trained role."""
        trained = {"rl": TRAINABLE_ROLES, **{s: (r,) for s, r in STAGE_TRAINED.items()}}[self.stage]
        return tuple(r for r in trained if r in self.roles)

    @property
    def served_weights(self) -> Dict[str, str]:
        """SERVED_WEIGHTS restricted to the roles the algorithm runs; with LoRA on ppo_policy, the
        reference too, where it is the base (the same checkpoint, network, precision and layout):
        it shares ppo_policy's base weights, which never change."""
        served = {s: t for s, t in SERVED_WEIGHTS.items() if s in self.roles and t in self.roles}
        policy = next((r for r in self.trainable_roles if ROLE_HEADS[r] == "lm"), None)  # the trained policy
        if policy is None:
            return served
        ref, trained = self.reference, self.role(policy)
        if trained.lora.enabled and "reference" in self.roles and ref.load == trained.load and \
                ref.model == trained.model and ref.precision == trained.precision and \
                self.layout_of("reference") == self.layout_of(policy):
            served["reference"] = policy
        return served

    def lora_of(self, role: str) -> LoRAConfig:
        """The adapters ``role``'s network carries: a trained role's own, a serving role its trained
        role's (the reference none: it is the base)."""
        if role == "reference":
            return LoRAConfig()
        if self.stage != "rl":  # nothing is served: the trained role's own
            return self.role(role).lora
        return self.role(SERVED_WEIGHTS.get(role, role)).lora

    @property
    def sequence_tokens(self) -> int:
        """The longest row a rollout holds (a prompt and its response, or a trajectory): the
        engine's KV cache length and the passes' sequence length."""
        if self.stage != "rl":  # a stage's rows are whole; RL's a prompt plus what is generated
            return self.stage_config.max_length
        if self.rollout.multi_turn:
            return self.rollout.trajectory_tokens(self.data, self.generation)
        return self.data.max_prompt_length + self.generation.max_new_tokens

    @property
    def response_tokens(self) -> int:
        """A response's budget of tokens after its prompt (Dr. GRPO's constant normaliser)."""
        return self.sequence_tokens - self.data.max_prompt_length

    @property
    def model_token_budget(self) -> int:
        """The most tokens the model writes in one response: generation.max_new_tokens, or a
        trajectory's turns (rollout.max_turns x the turn's limit); DAPO's overlong length."""
        if self.rollout.multi_turn:
            return self.rollout.max_turns * self.rollout.turn_tokens(self.generation)
        return self.generation.max_new_tokens

    @property
    def rollout_samples(self) -> int:
        """Responses per iteration over all DP ranks: prompts x samples_per_prompt."""
        return self.ppo.rollout_batch_size * self.generation.samples_per_prompt

    def weight_owner(self, role: str) -> Optional[str]:
        """The trained role whose weight storage ``role`` shares (same precision and layout), or
        None: then the role has weights of its own (a trained role, a frozen role, or a copy of
        another dtype or layout)."""
        owner = self.served_weights.get(role)
        same = owner and self.role(role).precision == self.role(owner).precision and self.layout_of(role) == self.layout_of(owner)
        return owner if same else None

    def layout_of(self, role: str) -> ParallelConfig:
        """The parallel layout ``role`` runs at: its own ``parallel`` sizes where set, else the run's."""
        own = self.role(role).parallel
        return dataclasses.replace(self.parallel, **{f.name: getattr(own, f.name) or getattr(self.parallel, f.name)
                                                     for f in dataclasses.fields(own)})

    def has_own_layout(self, role: str) -> bool:
        """Whether ``role`` runs at a layout other than the run's (its own process groups)."""
        return self.layout_of(role) != self.parallel

    def padded_vocab(self, arch: "ModelArchConfig") -> int:
        """Output rows of every model of the run: padded for the run's TP, so that models of other
        layouts exchange weights with the trained roles (megatron's resharding needs one size)."""
        return arch.padded_vocab_size(self.parallel.tensor_model_parallel_size)

    def samples_per_step(self, role: str) -> int:
        """Samples per optimizer step of a trainable role, over all DP ranks (default: the rollout)."""
        return self.role(role).global_batch_size or self.rollout_samples

    def settings(self) -> Dict:
        """Every setting as a nested dict, without the loader's bookkeeping (origin, refused)."""
        tree = dataclasses.asdict(self)
        for field in dataclasses.fields(self):
            if field.metadata.get("internal"):
                tree.pop(field.name)
        return tree

    def role(self, name: str) -> RoleConfig:
        if name not in ROLE_NAMES:
            raise KeyError(f"unknown role {name!r}; roles are {', '.join(ROLE_NAMES)}")
        return getattr(self, name)
