"""The model families we convert and run, one entry each: which Hugging Face config.json fields a
family has, what each means for our architecture (ModelArchConfig), the values we refuse, and the
features the family always has. Pure data and pure functions: the converters read a config.json
through :func:`arch_from_hf_config` and write one back with :func:`hf_config_from_arch`; the loader
applies a family's fixed features to a role's model (loader._apply_family).

Tensor names are the same in every family here (``model.layers.i.self_attn.q_proj.weight``, ...)
except where a mixture-of-experts family keeps its experts (``ExpertNames``); the features decide
which tensors exist (checkpoint/hf_decoder.py). Adding a family is one entry in FAMILIES plus its
test. A field that no rule names is refused by name: a field we do not read
would otherwise change the computation without a word.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_rlhf.config.schema import ModelArchConfig

_SKIP = object()  # a rule that writes nothing back


@dataclasses.dataclass(frozen=True)
class Rule:
    """One config.json field: ``read(value)`` -> (ModelArchConfig fields, problem or None);
    ``write(arch)`` -> the value to write back (``_SKIP``: leave the field out)."""

    read: Callable[[Any], Tuple[Dict[str, Any], Optional[str]]]
    write: Callable[[ModelArchConfig], Any]


def to(field: str, default: Any = None) -> Rule:
    """The field is our ``field`` (None: ``default``)."""
    return Rule(lambda v: ({field: default if v is None else v}, None), lambda arch: getattr(arch, field))


def only(*allowed: Any, why: str = "") -> Rule:
    """The field must be one of ``allowed`` (absent is fine); the first is written back."""
    def read(value):
        if value in allowed:
            return {}, None
        return {}, f"{value!r} is not supported (supported: {', '.join(repr(a) for a in allowed)}){why}"

    return Rule(read, lambda arch: allowed[0])


def ignored(write: Any = _SKIP) -> Rule:
    """A field that does not change what the model computes."""
    return Rule(lambda v: ({}, None), lambda arch: write)


def _full_attention_layers(value) -> Tuple[Dict[str, Any], Optional[str]]:
    if value is None or all(t == "full_attention" for t in value):
        return {}, None
    return {}, (f"{sorted(set(value))} is not supported (supported: every layer 'full_attention'; "
                "per-layer sliding windows are not modelled)")


FULL_ATTENTION_ONLY = Rule(_full_attention_layers, lambda arch: _SKIP)


# Written back as the effective width: some families' configs default it to another value.
HEAD_DIM = Rule(lambda v: ({"head_dim": v}, None), lambda arch: arch.kv_channels)


# Fields every family has.
COMMON: Dict[str, Rule] = {
    "hidden_size": to("hidden_size"),
    "intermediate_size": to("ffn_hidden_size"),
    "num_attention_heads": to("num_attention_heads"),
    "num_hidden_layers": to("num_layers"),
    "num_key_value_heads": Rule(lambda v: ({"num_query_groups": v}, None), lambda arch: arch.kv_groups),
    "vocab_size": to("vocab_size"),
    "max_position_embeddings": to("max_position_embeddings"),
    "rms_norm_eps": to("norm_epsilon"),
    "initializer_range": to("init_method_std", 0.02),
    "tie_word_embeddings": to("tie_word_embeddings", False),
    "hidden_act": only("silu", why=": the MLP is SwiGLU"),
    "attention_dropout": only(0.0, 0, why=": RL needs the same log-probs in rollout and training"),
}
# Fields that never change the computation (PretrainedConfig's generic ones and bookkeeping).
GENERIC = (
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
    "transformers_version", "use_cache", "_name_or_path", "num_labels", "id2label", "label2id", "problem_type",
    "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class", "is_encoder_decoder",
    "chunk_size_feed_forward", "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "is_decoder", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params", "finetuning_task",
    "torchscript", "pruned_heads", "use_bfloat16", "tf_legacy_loss", "output_scores", "return_dict_in_generate",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "_attn_implementation_autoset", "attn_implementation",
)
ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ROPE_KEYS = {
    "default": ("rope_type", "type", "rope_theta"),
    "linear": ("rope_type", "type", "rope_theta", "factor"),
    "llama3": ("rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    # not attention_factor: megatron derives the attention's factor from factor, mscale and mscale_all_dim
    "yarn": ("rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
}
_ROPE_NOT_MODELLED = {
    "dynamic": "dynamic NTK scaling changes the frequencies with each sequence's length",
    "longrope": "LongRoPE's per-dimension factors depend on the sequence length",
}


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """Where a mixture-of-experts family's checkpoint keeps a layer's experts, after
    ``model.layers.i.``: ``{block}.{router}.weight`` [experts, hidden] and
    ``{block}.experts.e.{gate|up|down}.weight`` for expert e."""

    block: str
    gate: str
    up: str
    down: str
    router: str = "gate"
    # A shared expert (Qwen2-MoE): ``{block}.{shared}.{gate|up|down}.weight`` and its sigmoid gate
    # ``{block}.{shared}_gate.weight`` [1, hidden].
    shared: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model family: its ``model_type`` (our name for it too), the class names
    written into ``architectures``, the fields of its config.json beyond COMMON and the rope
    fields, the features every model of it has, and for a mixture of experts where its experts are
    kept and the fields it must state (``a|b``: either; transformers' defaults for an absent one
    differ between versions)."""

    name: str
    prefix: str  # LlamaForCausalLM / LlamaForSequenceClassification
    fields: Dict[str, Rule]
    fixed: Dict[str, Any]
    experts: Optional[ExpertNames] = None
    required: Tuple[str, ...] = ()

    def architecture(self, head: str) -> str:
        return self.prefix + ("ForCausalLM" if head == "lm" else "ForSequenceClassification")

    @property
    def features(self) -> str:
        defaults = {f.name: f.default for f in dataclasses.fields(ModelArchConfig)}
        shown = [k for k, v in self.fixed.items() if v not in (False, None, [], defaults.get(k))]
        return ", ".join(shown) or "none beyond Llama's"


_NO_WINDOW = {"sliding_window": None}
_QWEN_WINDOW = {
    "use_sliding_window": only(False, why=": Qwen's per-layer sliding windows are not modelled"),
    # Read by transformers only when use_sliding_window is true.
    "sliding_window": ignored(None),
    "max_window_layers": ignored(),
    "layer_types": FULL_ATTENTION_ONLY,
}
# Read only when output_router_logits is true, i.e. by transformers' own training: our coefficient
# is the role's moe_aux_loss_coeff (0 unless set), so a converted model trains as its role says.
_ROUTER_TRAINING = {"output_router_logits": ignored(False), "router_aux_loss_coef": ignored()}
FAMILIES: Dict[str, Family] = {
    "llama": Family(
        "llama", "Llama",
        {
            "attention_bias": only(False, why=": Llama's attention_bias also biases o_proj; use Qwen2 for a "
                                   "q/k/v bias"),
            "mlp_bias": only(False),
            "head_dim": HEAD_DIM,
            "pretraining_tp": only(1),
        },
        {"qkv_bias": False, "qk_norm": False, **_NO_WINDOW},
    ),
    "qwen2": Family("qwen2", "Qwen2", dict(_QWEN_WINDOW), {"qkv_bias": True, "qk_norm": False, **_NO_WINDOW}),
    "qwen3": Family(
        "qwen3", "Qwen3",
        {"attention_bias": only(False, why=": Qwen3's attention_bias also biases o_proj"), "head_dim": HEAD_DIM,
         **_QWEN_WINDOW},
        {"qkv_bias": False, "qk_norm": True, **_NO_WINDOW},
    ),
    "mistral": Family(
        "mistral", "Mistral",
        {"head_dim": HEAD_DIM, "sliding_window": to("sliding_window")},
        {"qkv_bias": False, "qk_norm": False},
    ),
    "qwen3_moe": Family(
        "qwen3_moe", "Qwen3Moe",
        {"attention_bias": only(False, why=": Qwen3's attention_bias also biases o_proj"), "head_dim": HEAD_DIM,
         **_QWEN_WINDOW, **_ROUTER_TRAINING,
         "num_experts": to("num_experts"),
         "num_local_experts": Rule(lambda v: ({"num_experts": v}, None), lambda arch: _SKIP),  # transformers 5's name
         "moe_intermediate_size": to("moe_ffn_hidden_size"),
         "num_experts_per_tok": to("moe_router_topk"),
         "norm_topk_prob": to("moe_norm_topk_prob"),
         "decoder_sparse_step": to("moe_layer_step", 1),
         "mlp_only_layers": to("moe_dense_layers", [])},
        {"qkv_bias": False, "qk_norm": True, "moe_shared_expert_ffn_hidden_size": None, **_NO_WINDOW},
        experts=ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
        required=("num_experts|num_local_experts", "moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob"),
    ),
    "qwen2_moe": Family(
        "qwen2_moe", "Qwen2Moe",
        {**_QWEN_WINDOW, **_ROUTER_TRAINING,
         "qkv_bias": only(True, why=": Qwen2-MoE's attention has q/k/v biases"),  # transformers 5 writes it
         "num_experts": to("num_experts"),
         "moe_intermediate_size": to("moe_ffn_hidden_size"),
         "shared_expert_intermediate_size": to("moe_shared_expert_ffn_hidden_size"),
         "num_experts_per_tok": to("moe_router_topk"),
         "norm_topk_prob": to("moe_norm_topk_prob"),
         "decoder_sparse_step": to("moe_layer_step", 1),
         "mlp_only_layers": to("moe_dense_layers", [])},
        {"qkv_bias": True, "qk_norm": False, **_NO_WINDOW},
        experts=ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_expert"),
        required=("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
                  "norm_topk_prob"),
    ),
    "mixtral": Family(
        "mixtral", "Mixtral",
        {"head_dim": HEAD_DIM, "sliding_window": to("sliding_window"), **_ROUTER_TRAINING,
         # Every layer has experts; intermediate_size is their width.
         "intermediate_size": Rule(lambda v: ({"ffn_hidden_size": v, "moe_ffn_hidden_size": v}, None),
                                   lambda arch: arch.moe_ffn_hidden_size),
         "num_local_experts": to("num_experts"),
         "num_experts_per_tok": to("moe_router_topk"),
         "router_jitter_noise": only(0.0, 0, why=": noise on the router would route the rollout and training "
                                     "differently")},
        {"qkv_bias": False, "qk_norm": False, "moe_norm_topk_prob": True, "moe_layer_step": 1, "moe_dense_layers": [],
         "moe_shared_expert_ffn_hidden_size": None},
        experts=ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
        required=("num_local_experts", "num_experts_per_tok"),
    ),
}
REQUIRED_HF_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def family_of(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"family {name!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def _rope(cfg: dict) -> Tuple[Dict[str, Any], List[str]]:
    """Our rotary fields from rope_theta / rope_scaling (transformers 4) or rope_parameters (5)."""
    scaling = cfg.get("rope_scaling") or {}
    params = dict(cfg.get("rope_parameters") or scaling)
    if scaling and params.get("rope_type", params.get("type")) != scaling.get("rope_type", scaling.get("type")):
        return {}, [f"rope_scaling {scaling} and rope_parameters {params} disagree"]
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        reason = _ROPE_NOT_MODELLED.get(kind, "")
        return {}, [f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
                    + (f": {reason}" if reason else "")]
    extra = sorted(set(params) - set(_ROPE_KEYS[kind]))
    if extra:
        return {}, [f"rope parameters {', '.join(extra)} are not supported for rope type {kind!r} "
                    f"(supported: {', '.join(_ROPE_KEYS[kind][2:])})"]
    out: Dict[str, Any] = {"rotary_base": float(theta), "rope_scaling": "none" if kind == "default" else kind}
    if kind == "yarn":  # as transformers reads it (modeling_rope_utils._compute_yarn_parameters)
        original = int(params.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        out.update(rope_scaling_factor=float(params.get("factor") or cfg["max_position_embeddings"] / original),
                   rope_original_max_position_embeddings=original,
                   rope_beta_fast=float(params.get("beta_fast") or 32), rope_beta_slow=float(params.get("beta_slow") or 1),
                   rope_truncate=bool(params.get("truncate", True)))
        if params.get("mscale") and params.get("mscale_all_dim"):
            out.update(rope_mscale=float(params["mscale"]), rope_mscale_all_dim=float(params["mscale_all_dim"]))
        return out, []
    if kind != "default":
        out["rope_scaling_factor"] = float(params.get("factor", 1.0))
    if kind == "llama3":
        missing = [k for k in _ROPE_KEYS["llama3"][3:] if k not in params]
        if missing:
            return {}, [f"rope type 'llama3' needs {', '.join(missing)}"]
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    return out, []


def _rope_parameters(arch: ModelArchConfig) -> dict:
    out: Dict[str, Any] = {"rope_theta": arch.rotary_base, "rope_type": "default" if arch.rope_scaling == "none" else arch.rope_scaling}
    if arch.rope_scaling != "none":
        out["factor"] = arch.rope_scaling_factor
    if arch.rope_scaling == "llama3":
        out.update(low_freq_factor=arch.rope_low_freq_factor, high_freq_factor=arch.rope_high_freq_factor,
                   original_max_position_embeddings=arch.rope_original_max_position_embeddings)
    if arch.rope_scaling == "yarn":
        out.update(original_max_position_embeddings=arch.rope_original_max_position_embeddings,
                   beta_fast=arch.rope_beta_fast, beta_slow=arch.rope_beta_slow, truncate=arch.rope_truncate)
        if arch.rope_mscale is not None:
            out.update(mscale=arch.rope_mscale, mscale_all_dim=arch.rope_mscale_all_dim)
    return out


def arch_from_hf_config(cfg: dict, source: str) -> ModelArchConfig:
    """Our architecture from a Hugging Face config.json (``source`` names the file in errors).
    Every field is read by a rule of the family or refused; all problems are reported at once."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    family = FAMILIES[model_type]
    missing = [k for k in REQUIRED_HF_FIELDS + family.required if not any(a in cfg for a in k.split("|"))]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}; is this a {family.prefix} config.json?")
    rules = {**COMMON, **family.fields}
    fields: Dict[str, Any] = {"family": family.name, **family.fixed}
    rope, problems = _rope(cfg)
    fields.update(rope)
    for key, value in cfg.items():
        if key in ROPE_FIELDS or key in GENERIC:
            continue
        if key not in rules:
            problems.append(f"{key}: not a field of the {family.name} family that we model "
                            f"(it would change the computation unread); remove it or convert another family")
            continue
        read, problem = rules[key].read(value)
        if problem:
            problems.append(f"{key}: {problem}")
        fields.update(read)
    if fields.get("head_dim") == cfg["hidden_size"] // cfg["num_attention_heads"]:
        fields["head_dim"] = None  # the default width, kept implicit
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))
    return ModelArchConfig(**fields)


def hf_config_from_arch(arch: ModelArchConfig, head: str, dtype_name: str) -> dict:
    """The config.json of ``arch`` that transformers loads as the same model."""
    family = family_of(arch.family)
    cfg: Dict[str, Any] = {"architectures": [family.architecture(head)], "model_type": family.name}
    for key, rule in {**COMMON, **family.fields}.items():
        value = rule.write(arch)
        if value is not _SKIP:
            cfg[key] = value
    cfg["rope_theta"] = arch.rotary_base
    cfg["rope_parameters"] = _rope_parameters(arch)
    cfg["torch_dtype"] = dtype_name
    if head == "scalar":
        cfg["num_labels"] = 1
    return cfg


def feature_conflicts(arch: ModelArchConfig, explicit: set) -> List[Tuple[str, str]]:
    """(key, message) for each explicitly set feature that contradicts ``arch.family``'s fixed ones."""
    family = family_of(arch.family)
    return [(key, f"{getattr(arch, key)!r} contradicts family {family.name!r}, whose models always have "
                  f"{key}: {value!r}") for key, value in family.fixed.items() if key in explicit and getattr(arch, key) != value]
