"""The configuration reference, generated from the schema: every key with its type, default,
allowed values, meaning and the stages that read it. The meaning is written once, beside the field
in schema.py (the comment lines right above it and its trailing comment; a section's, its class
docstring), as megatron-core documents its config dataclasses.

    python -m megatron_rlhf.config.reference > docs/config_reference.md   # the whole reference
    python -m megatron_rlhf.train --explain ppo.clip_ratio_c                # one key
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import typing
from typing import Dict, List, Optional

from megatron_rlhf.config import schema
from megatron_rlhf.config.schema import (CRITIC_ROLES, RL_ONLY_KEYS, RL_ONLY_SECTIONS, ROLE_NAMES, SERVED_WEIGHTS,
                                         STAGE_ONLY_KEYS, STAGE_ROLES, STAGE_TRAINED, TRAINABLE_ROLES,
                                         TRAINED_ROLE_KEYS, RLHFConfig)

STAGES_BEFORE_RL = tuple(STAGE_ROLES)


@dataclasses.dataclass(frozen=True)
class Entry:
    key: str  # dotted; a role's key as <role>.name
    type: str
    default: str
    allowed: str
    read_by: str
    meaning: str


def _comments_of_fields() -> Dict[str, str]:
    """'Class.field' -> the comment lines right above the field and its trailing comment, joined."""
    source = inspect.getsource(schema)
    lines = source.splitlines()
    docs = {}
    for cls in (n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            above, i = [], node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            last = lines[node.end_lineno - 1]
            trailing = last.split("  # ", 1)[1].strip() if "  # " in last else ""
            docs[f"{cls.name}.{node.target.id}"] = " ".join(above + ([trailing] if trailing else []))
    return docs


def _first_paragraph(cls) -> str:
    return " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())


def _type_text(annotation) -> str:
    """A type as a reader says it: ``int or null``, ``list of str``, ``choice`` (the allowed words)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "choice"
    if origin is typing.Union:
        named = [_type_text(a) for a in args if a is not type(None)]
        return " or ".join(named + (["null"] if type(None) in args else []))
    if origin is list:
        return f"list of {_type_text(args[0])}"
    if origin is dict:
        return f"map of {_type_text(args[0])} to {_type_text(args[1])}"
    return getattr(annotation, "__name__", str(annotation))


def _allowed(field: dataclasses.Field, annotation) -> str:
    words = [a for arg in (typing.get_args(annotation) or (annotation,))
             for a in (typing.get_args(arg) if typing.get_origin(arg) is typing.Literal else ())]
    if typing.get_origin(annotation) is typing.Literal:
        words = list(typing.get_args(annotation))
    parts = [", ".join(map(str, words))] if words else []
    domain = field.metadata.get("domain")
    if domain is not None:
        bounds = [f"{op} {bound:g}" for op, bound in ((">=", domain.ge), (">", domain.gt), ("<=", domain.le),
                                                    ("<", domain.lt)) if bound is not None]
        parts.append(" and ".join(bounds))
    return "; ".join(p for p in parts if p)


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return ""
    if dataclasses.is_dataclass(value):
        return "(section)"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value) \
        if isinstance(value, str) else str(value)


def _read_by(key: str) -> str:
    """The stages (and, for the critic's roles, the estimator) that read ``key``."""
    head = key.split(".")[0]
    if head in RL_ONLY_SECTIONS or key in RL_ONLY_KEYS:
        return "rl"
    if head in STAGES_BEFORE_RL:
        return head
    if key in STAGE_ONLY_KEYS:
        return ", ".join(STAGES_BEFORE_RL)
    if head == "<role>":
        return "per role (see the roles' section)"
    return "every stage"


def _stages_of(role: str) -> str:
    """The stages that build ``role``."""
    return ", ".join(["rl (gae only)" if role in CRITIC_ROLES else "rl"] +
                     [s for s, roles in STAGE_ROLES.items() if role in roles])


def _role_key_readers(role: str, field: str) -> str:
    """Who reads ``role``'s key ``field``: the stages that build the role, or for a trained role's
    key (TRAINED_ROLE_KEYS, lora) those that train it, and what to set where it is served."""
    if field not in TRAINED_ROLE_KEYS + ("lora",):
        return _stages_of(role)
    trained = (["rl (gae only)" if role in CRITIC_ROLES else "rl"] if role in TRAINABLE_ROLES else []) + \
        [s for s, r in STAGE_TRAINED.items() if r == role]
    served = f"; in rl set {SERVED_WEIGHTS[role]}.{field} ({role} runs its weights)" if role in SERVED_WEIGHTS else ""
    if not trained:
        return f"no stage: {role} is never trained (refused where set){served}"
    return f"{', '.join(trained)}, where {role} is trained (refused where it is not){served}"


def _role_readers() -> List[str]:
    return [f"`{role}`: {_stages_of(role)}" for role in ROLE_NAMES]


def entries() -> List[Entry]:
    """Every key of the config, in the schema's order; a role's keys once, as <role>.name (the
    reward's own keys as reward.name)."""
    docs = _comments_of_fields()
    found: List[Entry] = []

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.metadata.get("internal"):
                continue
            key, annotation = prefix + field.name, hints[field.name]
            nested = annotation if dataclasses.is_dataclass(annotation) else None
            meaning = next((docs[f"{k.__name__}.{field.name}"] for k in cls.__mro__  # an inherited field: its class's
                            if f"{k.__name__}.{field.name}" in docs), "")
            if nested is not None and prefix == "" and field.name in ROLE_NAMES:
                continue  # the roles are one section of their own
            if nested is not None:
                found.append(Entry(key, nested.__name__, "(section)", "", _read_by(key),
                                   meaning or _first_paragraph(nested)))
                walk(nested, key + ".")
                continue
            found.append(Entry(key, _type_text(annotation), _default(field), _allowed(field, annotation),
                               _read_by(key), meaning))

    walk(RLHFConfig, "")
    walk(schema.RoleConfig, "<role>.")
    role_keys = {f.name for f in dataclasses.fields(schema.RoleConfig)}
    own = [f for f in dataclasses.fields(schema.RewardRoleConfig) if f.name not in role_keys]
    hints = typing.get_type_hints(schema.RewardRoleConfig)
    readers = {"normalize": "rl (reward.type: model)", "type": "rl", "max_abs_score": "rl",
               "step_separator": "rl (reward.type: model)", "step_aggregation": "rl (reward.step_separator)"}
    found += [Entry(f"reward.{f.name}", _type_text(hints[f.name]), _default(f), _allowed(f, hints[f.name]),
                    readers.get(f.name, "rl (reward.type: function)"), docs.get(f"RewardRoleConfig.{f.name}", ""))
              for f in own]
    own = [f for f in dataclasses.fields(schema.JudgeRoleConfig) if f.name not in role_keys]
    hints = typing.get_type_hints(schema.JudgeRoleConfig)
    found += [Entry(f"judge.{f.name}", _type_text(hints[f.name]), _default(f), _allowed(f, hints[f.name]),
                    "rl" if f.name == "enabled" else "rl (judge.enabled)", docs.get(f"JudgeRoleConfig.{f.name}", ""))
              for f in own]
    return found


# A peer's name for a setting -> ours (docs/guide/coming-from-trl-and-verl.md has the whole tables):
# --explain answers a name a TRL or verl user types with the key it means here.
PEERS_NAMES = {
    "num_generations": ("TRL's", "generation.samples_per_prompt"),
    "max_completion_length": ("TRL's", "generation.max_new_tokens"),
    "learning_rate": ("TRL's", "ppo_policy.lr"),
    "beta": ("TRL's (the KL in the loss with kl_in_loss; DPO's: dpo.beta)", "ppo.kl_coef"),
    "epsilon": ("TRL's", "ppo.clip_ratio_low"),
    "epsilon_high": ("TRL's", "ppo.clip_ratio_high"),
    "num_iterations": ("TRL's", "ppo.ppo_epochs"),
    "scale_rewards": ("TRL's", "algorithm.norm_adv_by_std_in_grpo"),
    "num_train_epochs": ("TRL's (SFT's; rm.epochs, dpo.epochs likewise)", "sft.epochs"),
    "rollout.n": ("verl's", "generation.samples_per_prompt"),
    "max_response_length": ("verl's", "generation.max_new_tokens"),
    "train_batch_size": ("verl's (prompts per step)", "ppo.rollout_batch_size"),
    "ppo_mini_batch_size": ("verl's (prompts; here responses)", "<role>.global_batch_size"),
    "ppo_micro_batch_size_per_gpu": ("verl's", "<role>.micro_batch_size"),
    "ppo_max_token_len_per_gpu": ("verl's", "<role>.max_tokens_per_micro_batch"),
    "use_remove_padding": ("verl's", "<role>.pack_rows"),
    "kl_loss_coef": ("verl's", "ppo.kl_coef"),
    "adv_estimator": ("verl's", "algorithm.advantage_estimator"),
    "total_training_steps": ("verl's", "ppo.iterations"),
    "save_freq": ("verl's", "trainer.save_interval"),
}


def explain(key: str) -> str:
    """One key's entry as text (a peer's name for one: ours, and its entry); ValueError naming the
    closest keys for one that does not exist."""
    table = {e.key: e for e in entries()}
    parts = key.split(".")
    endings = (".".join(parts[i:]) for i in range(len(parts)))  # a peer's full path too: actor_rollout_ref.rollout.n
    peer = next((PEERS_NAMES[ending] for ending in endings if ending in PEERS_NAMES), None)
    if peer is not None and key not in table:
        whose, ours = peer
        return f"{key} is {whose} name; here: {ours}\n" + explain(ours)
    role, _, rest = key.partition(".")
    wanted = table.get(key) or (table.get(f"<role>.{rest}") if role in ROLE_NAMES else None)
    if wanted is None:
        close = difflib.get_close_matches(key, list(table), n=3)
        raise ValueError(f"{key}: no such key" + (f"; did you mean {', '.join(close)}?" if close else "") +
                         " (the whole reference: docs/config_reference.md)")
    read_by = _role_key_readers(role, rest.split(".")[0]) if wanted.key.startswith("<role>.") else wanted.read_by
    lines = [f"{key}: {wanted.meaning}", f"  type: {wanted.type}", f"  default: {wanted.default}"]
    if wanted.allowed:
        lines.append(f"  allowed: {wanted.allowed}")
    lines.append(f"  read by: {read_by}")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """docs/config_reference.md."""
    out = ["# Configuration reference", "",
           "Generated from `megatron_rlhf/config/schema.py` by `python -m megatron_rlhf.config.reference` (a test fails "
           "when the two differ); `python -m megatron_rlhf.train --explain KEY` prints one entry. Keys are written as "
           "YAML sections (`ppo: {clip_ratio: 0.2}`) or set from environment variables through `${VAR:default}` "
           "(docs/guide/configuration.md). A key a run's stage does not read is refused by name, never ignored.", ""]
    section: Optional[str] = None
    for e in entries():
        top = e.key.split(".")[0] if "." in e.key or e.default == "(section)" else ""
        if top != section:
            section = top
            title = "The roles: policy, reference, reward, value, ppo_policy, ppo_value" if top == "<role>" else \
                f"`{top}`" if top else "Top-level keys"
            out += ["", f"## {title}", ""]
            if top == "<role>":
                out += ["Every role takes these keys under its name (`ppo_policy: {lr: 1e-6}`). The stages that build each "
                        "role: " + "; ".join(_role_readers()) + ".", ""]
            out += ["| key | type | default | allowed | read by | meaning |", "|---|---|---|---|---|---|"]
        out.append(f"| `{e.key}` | {_cell(e.type)} | {_cell(e.default)} | {_cell(e.allowed)} | {_cell(e.read_by)} | "
                   f"{_cell(e.meaning)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
