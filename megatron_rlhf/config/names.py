"""The names a config chooses from for the RL math and the tools, in one place: config/schema.py
types its keys by them, and megatron_rlhf.ppo and megatron_rlhf.agents implement and dispatch on
exactly these (``registry`` checks it when their tables are built). Torch-free, like the rest of
the config package."""

from typing import Dict, Sequence, TypeVar

T = TypeVar("T")

# algorithm.advantage_estimator (ppo/advantages.py ESTIMATORS)
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
CRITIC_ESTIMATORS = ("gae",)  # need the value model
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")  # baseline: the prompt's other responses
# ppo.kl_estimator (ppo/core.py KL_ESTIMATES)
KL_ESTIMATORS = ("k1", "k3", "low_var_kl")
# ppo.loss_agg_mode (ppo/core.py LOSS_AGGREGATIONS)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# those whose loss is a sum over tokens, which context parallelism cuts over its ranks
TOKEN_SUM_AGG_MODES = ("token-mean",)
# ppo.policy_loss (ppo/core.py POLICY_LOSSES), and the ppo.loss_agg_mode a loss's objective needs
POLICY_LOSSES = ("vanilla", "gspo")
LOSS_AGG_MODE_OF = {"gspo": ("seq-mean-token-mean", "GSPO's objective is a mean over sequences of the sequence's "
                                                     "clipped ratio")}
# algorithm.rollout_correction.mode and .level (ppo/correction.py CORRECTIONS)
ROLLOUT_CORRECTIONS = ("off", "truncate", "mask")
CORRECTION_LEVELS = ("token", "sequence")
# stage: what a run trains (megatron_rlhf/stages for the stages before RL; rl: train.py's loop)
STAGES = ("rl", "sft", "rm", "prm", "dpo")
# dpo.loss_type (preference/losses.py DPO_LOSSES)
DPO_LOSSES = ("sigmoid", "ipo")
# judge.parser (rewards/verdicts.py PARSERS): how a judge's verdict becomes a score
JUDGE_PARSERS = ("number", "boxed", "choice", "function")
# judge.combine (rewards/verdicts.py COMBINES): how a response's judge.samples verdicts make its score
JUDGE_COMBINES = ("mean", "majority", "min", "max")
# judge.template: the fields it fills in, each written {name} (other braces are text)
JUDGE_FIELDS = ("prompt", "response", "reference")
JUDGE_FIELD_PATTERN = r"\{(prompt|response|reference)\}"
# reward.step_aggregation (ppo/core.py STEP_AGGREGATIONS): a process reward model's step scores as a
# response's score, or (token) each at its step's end as a per-token reward, which only the estimators
# of per-token returns read
STEP_AGGREGATIONS = ("min", "last", "mean", "token")
TOKEN_REWARD_ESTIMATORS = ("gae", "reinforce_plus_plus")
# <role>.lora.target_modules: megatron's linears an adapter may sit on (models/lora.py)
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# The roles of a chat message (data rows, environments' observations).
CHAT_ROLES = ("system", "user", "assistant", "tool")
# rollout.tool_parser (agents/parsers.py PARSERS)
TOOL_PARSERS = ("hermes", "llama3_json", "tags")
PLAIN_TEXT_PARSERS = ("tags",)  # calls written as plain text: no chat template's tools block needed
# rollout.sandbox.kind (agents/sandbox SANDBOXES): where the Python tool runs model-written code; the
# keys of rollout.sandbox only one kind reads
SANDBOX_KINDS = ("isolated", "remote", "unsafe_process")
# The sandbox keys only some kinds read (a service sets its own CPU, file and descriptor limits).
SANDBOX_KIND_KEYS = {"url": ("remote",), "max_concurrent_calls": ("remote",), "retries": ("remote",),
                     "disk_mb": ("isolated",), "inodes": ("isolated",), "threads": ("isolated",),
                     "cpu_s": ("isolated", "unsafe_process"), "file_mb": ("isolated", "unsafe_process"),
                     "open_files": ("isolated", "unsafe_process")}


def registry(names: Sequence[str], key: str, implementations: Dict[str, T]) -> Dict[str, T]:
    """A name -> implementation table, checked against ``names`` (the domain of config key
    ``key``) where it is built: an implementation without a name, or a name without one, stops the
    import instead of failing a run. In the order of ``names``."""
    missing, unknown = set(names) - set(implementations), set(implementations) - set(names)
    if missing or unknown:
        raise RuntimeError(f"{key}: the config's names {tuple(names)} and the implementations "
                           f"{tuple(implementations)} differ (missing {sorted(missing)}, unnamed {sorted(unknown)})")
    return {name: implementations[name] for name in names}


def chosen(table: Dict[str, T], name: str, key: str) -> T:
    """``table``'s entry for ``name``; ValueError naming config key ``key`` and its names."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"{key} must be one of {', '.join(table)}, got {name!r}") from None
