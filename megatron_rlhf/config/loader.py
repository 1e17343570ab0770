"""YAML loading: ``${ENV_NAME:default}`` interpolation, ``includes:``, role model files, and
conversion to the typed objects of schema.py with errors that name the file, the key and what is valid.

Every leaf value remembers the file it came from, so an error found later (for example a TP size
that does not divide the heads of a model defined in another file) can still name the right file.
"""

from __future__ import annotations

import copy
import math
import dataclasses
import difflib
import json
import os
import re
import typing
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml

from megatron_rlhf.config.errors import ConfigError, located
from megatron_rlhf.config.families import FAMILIES, feature_conflicts
from megatron_rlhf.config.presets import AUTO, CHECKPOINT_META_FILE, PRESETS
from megatron_rlhf.config.schema import (COMMAND_LINE, REQUIRED_ARCH_FIELDS, ROLE_NAMES, SERVED_WEIGHTS, ModelArchConfig, RewardRoleConfig,
                                         RLHFConfig)
from megatron_rlhf.config.validation import layout_problems, validate

KeyPath = Tuple[str, ...]
Sources = Dict[KeyPath, str]

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


def dotted(path: KeyPath) -> str:
    return ".".join(path) if path else "<top level>"


# --------------------------------------------------------------------------------------------------
# Scalars and ${ENV:default}


def parse_scalar(text: str) -> Any:
    """Type a scalar given as text: true/false -> bool, integers, floats, empty or null -> None,
    anything else stays a string."""
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("", "null", "none", "~"):
        return None
    for convert in (int, float):
        try:
            return convert(stripped)
        except ValueError:
            pass
    return text


class LeafSource(str):
    """The file a value was read from; ``env`` is ``NAME=value`` when the whole value came from an
    environment variable, so that errors can name the variable the user set."""

    env: Optional[str] = None

    @classmethod
    def of(cls, file: str, env: Optional[str] = None) -> "LeafSource":
        source = cls(file)
        source.env = env
        return source


def _lookup(match: "re.Match[str]", file: str, path: KeyPath) -> Tuple[str, bool]:
    """The text of one ``${NAME:default}`` reference, and whether the environment supplied it."""
    name, default = match.group(1), match.group(2)
    if name in os.environ:
        return os.environ[name], True
    if default is None:
        raise ConfigError(
            f"{file}: {dotted(path)}: environment variable {name} is not set and "
            f"'${{{name}}}' has no default; export {name} or write '${{{name}:default}}'"
        )
    return default, False


def interpolate(value: str, file: str, path: KeyPath) -> Any:
    """Resolve ``${NAME:default}`` references; the environment wins over the default. A value that
    is one reference is typed (see parse_scalar); references inside longer text are substituted."""
    return _interpolate_leaf(value, file, path)[0]


def _interpolate_leaf(value: str, file: str, path: KeyPath) -> Tuple[Any, LeafSource]:
    whole = _ENV_REF.fullmatch(value.strip())
    if whole:
        text, from_env = _lookup(whole, file, path)
        name = whole.group(1)
        return parse_scalar(text), LeafSource.of(file, f"{name}={text}" if from_env else f"{name}, not set")
    return _ENV_REF.sub(lambda m: _lookup(m, file, path)[0], value), LeafSource.of(file)


def _interpolate_tree(node: Any, file: str, path: KeyPath, sources: Sources) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, child in node.items():
            if not isinstance(key, str):
                raise ConfigError(f"{file}: {dotted(path)}: key {key!r} must be a string")
            out[key] = _interpolate_tree(child, file, path + (key,), sources)
        sources[path] = file
        return out
    sources[path] = file
    if isinstance(node, list):
        return [_interpolate_tree(v, file, path + (str(i),), sources) for i, v in enumerate(node)]
    if isinstance(node, str):
        value, sources[path] = _interpolate_leaf(node, file, path)
        return value
    return node


# --------------------------------------------------------------------------------------------------
# Files and includes


class _YamlLoader(yaml.SafeLoader):
    """YAML whose booleans are true and false only (YAML 1.2's, and parse_scalar's): YAML 1.1 also
    reads on/off/yes/no as booleans, so a key whose values include "off" would get False."""


_BOOL = "tag:yaml.org,2002:bool"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _read_yaml(file: str, named_by: Optional[str]) -> Dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_YamlLoader)
    except FileNotFoundError:
        where = f" (named by {named_by})" if named_by else ""
        raise ConfigError(f"{file}: no such config file{where}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}:{_first_non_utf8_line(file)}: not UTF-8 text; save the file as UTF-8") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level must be a mapping of keys, not {type(data).__name__}")
    return data


def _first_non_utf8_line(file: str) -> int:
    with open(file, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


# Mappings whose entries an including file may remove with ``null`` (an included recipe's reward
# functions: switching a verifier by include).
REMOVABLE_ENTRIES = (("reward", "functions"),)


def _merge(base: Dict, base_sources: Sources, over: Dict, over_sources: Sources, at: KeyPath) -> None:
    """Deep-merge ``over`` into ``base`` (over wins), keeping each leaf's source file; ``null`` on
    an entry of a REMOVABLE_ENTRIES mapping removes the entry."""
    for key, value in over.items():
        path = at + (key,)
        if value is None and at in REMOVABLE_ENTRIES:
            if key not in base:
                raise ConfigError(f"{over_sources.get(path, '<config>')}: {'.'.join(path)}: null removes an entry an included file "
                                  f"sets, but none sets {key!r} (set: {', '.join(map(str, base)) or 'nothing'})")
            del base[key]
            for src_path in [p for p in base_sources if p[: len(path)] == path]:
                del base_sources[src_path]
            continue
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], base_sources, value, over_sources, path)
            base_sources.setdefault(path, over_sources[path])
        else:
            base[key] = value
            for src_path in [p for p in base_sources if p[: len(path)] == path]:
                del base_sources[src_path]
            base_sources.update({p: f for p, f in over_sources.items() if p[: len(path)] == path})


def load_tree(file: str, named_by: Optional[str] = None, _stack: Tuple[str, ...] = ()) -> Tuple[Dict, Sources]:
    """Load one YAML file with its ``includes:`` (paths relative to it, merged in order, then the
    file's own keys on top) and ``${ENV:default}`` resolved. Returns the tree and leaf sources."""
    file = os.path.abspath(file)
    if file in _stack:
        chain = " -> ".join(_stack + (file,))
        raise ConfigError(f"{file}: includes itself through {chain}")
    data = _read_yaml(file, named_by)
    includes = data.pop("includes", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{file}: includes: expected a file path or a list of file paths")
    tree: Dict = {}
    sources: Sources = {}
    for include in includes:
        inc_file = os.path.join(os.path.dirname(file), include)
        sub, sub_sources = load_tree(inc_file, named_by=f"{file}: includes", _stack=_stack + (file,))
        _merge(tree, sources, sub, sub_sources, ())
    own_sources: Sources = {}
    own = _interpolate_tree(data, file, (), own_sources)
    _merge(tree, sources, own, own_sources, ())
    return tree, sources


def _attach_role_model_files(tree: Dict, sources: Sources) -> None:
    """A role's ``model_config_file`` (relative to the file that names it) is the base of that
    role's entry; keys in the entry itself override it."""
    for role in ROLE_NAMES:
        entry = tree.get(role)
        if not isinstance(entry, dict) or entry.get("model_config_file") is None:
            continue
        name = entry["model_config_file"]
        naming_file = sources[(role, "model_config_file")]
        if not isinstance(name, str):
            raise ConfigError(f"{naming_file}: {role}.model_config_file: expected a file path")
        model_file = os.path.join(os.path.dirname(naming_file), name)
        sub, sub_sources = load_tree(model_file, named_by=f"{naming_file}: {role}.model_config_file")
        merged: Dict = {}
        merged_sources: Sources = {(role,): model_file}
        _merge(merged, merged_sources, sub, {(role,) + p: f for p, f in sub_sources.items()}, (role,))
        entry_sources = {p: f for p, f in sources.items() if p[:1] == (role,)}
        _merge(merged, merged_sources, entry, entry_sources, (role,))
        tree[role] = merged
        for p in entry_sources:
            del sources[p]
        sources.update(merged_sources)


# --------------------------------------------------------------------------------------------------
# Typed objects


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        names = [_type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(names) + (" (or null)" if type(None) in typing.get_args(tp) else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"a mapping of {_type_name(key)} to {_type_name(value)}"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _bad_entries(value: Any, tp: Any) -> List[Tuple[Any, Any, Any]]:
    """(key, value, expected type) of each entry of a mapping ``value`` that its (possibly
    optional) mapping type ``tp`` refuses; [] when ``value`` is no mapping or its keys are wrong."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
    mapping = next((a for a in args if typing.get_origin(a) is dict), None)
    if mapping is None or not isinstance(value, dict):
        return []
    key_type, value_type = typing.get_args(mapping)
    if not all(_check_type(k, key_type)[0] for k in value):
        return []
    return [(k, v, value_type) for k, v in value.items() if not _check_type(v, value_type)[0]]


def _check_type(value: Any, tp: Any) -> Tuple[bool, Any]:
    """Whether ``value`` is acceptable for ``tp``, and the value to store (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        if value is None and type(None) in typing.get_args(tp):
            return True, None
        for arg in typing.get_args(tp):
            if arg is not type(None):
                ok, converted = _check_type(value, arg)
                if ok:
                    return True, converted
        return False, value
    if origin is typing.Literal:
        return value in typing.get_args(tp), value
    if origin is dict:
        if not isinstance(value, dict) or not value:
            return False, value
        key_type, value_type = typing.get_args(tp)
        checked = {k: _check_type(v, value_type) for k, v in value.items()}
        ok = all(_check_type(k, key_type)[0] and good for k, (good, _) in checked.items())
        return ok, {k: v for k, (_, v) in checked.items()}
    if origin is list:
        if not isinstance(value, list):
            return False, value
        checked = [_check_type(v, typing.get_args(tp)[0]) for v in value]
        return all(good for good, _ in checked), [v for _, v in checked]
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:  # finite: an infinite learning rate or beta would only fail at the first step
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    return isinstance(value, tp), value


def _shown(value: Any) -> str:
    """A refused value as a message shows it."""
    if value is None:
        return "nothing (empty)"
    finite = not isinstance(value, float) or math.isfinite(value)
    return f"{type(value).__name__} {value!r}" + ("" if finite else " (a number must be finite)")


def build(cls: type, data: Any, sources: Sources, path: KeyPath, top_file: str, problems: List[str],
          refused: Optional[List[str]] = None) -> Any:
    """Build dataclass ``cls`` from ``data``. Unknown keys and wrong types are appended to
    ``problems`` (all of them, each naming file, key and what is valid) and left at their defaults;
    their dotted keys to ``refused``."""
    refused = [] if refused is None else refused

    def where(p: KeyPath) -> str:
        probe = p
        while probe and probe not in sources:
            probe = probe[:-1]
        return sources.get(probe, top_file)

    if not isinstance(data, dict):
        problems.append(f"{located(where(path), dotted(path))}: expected a mapping of keys, got {data!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in data.items():
        key_path = path + (key,)
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            problems.append(
                f"{located(where(key_path), dotted(key_path))}: unknown key; {hint}valid keys here are: "
                + ", ".join(sorted(fields))
            )
            refused.append(dotted(key_path))
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build(tp, value, sources, key_path, top_file, problems, refused)
            continue
        ok, converted = _check_type(value, tp)
        if ok:
            kwargs[key] = converted
            continue
        refused.append(dotted(key_path))
        entries = _bad_entries(value, tp)
        if entries:  # each wrong entry of a mapping, named where it was set (an include's may be fine)
            problems.extend(f"{located(where(key_path + (k,)), dotted(key_path + (k,)))}: expected {_type_name(inner)}, "
                            f"got {_shown(v)}" for k, v, inner in entries)
            continue
        shown = _shown(value)
        if isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?e\d+", value.strip(), re.I):
            shown += f" (YAML reads an exponent without a sign as text: write {value.lower().replace('e', 'e+')})"
        problems.append(f"{located(where(key_path), dotted(key_path))}: expected {_type_name(tp)}, got {shown}")
    obj = cls(**kwargs)
    if isinstance(obj, ModelArchConfig):
        problems.extend(_apply_preset(obj, set(kwargs), where, path))
    return obj


def _apply_preset(model: ModelArchConfig, explicit: set, where: Callable[[KeyPath], str], path: KeyPath) -> List[str]:
    """The preset's values for every key not given explicitly, then the family's fixed features;
    a given key that contradicts its family is an error."""
    file = where(path + ("preset",))
    if model.preset == AUTO:
        return []  # once the config is read: the role's checkpoint (_models_from_checkpoints)
    if model.preset is not None:
        if model.preset not in PRESETS:
            return [
                f"{file}: {dotted(path + ('preset',))}: unknown preset {model.preset!r}; "
                f"valid presets are: {', '.join(PRESETS)}, or {AUTO} (the architecture of the role's checkpoint)"
            ]
        for key, value in PRESETS[model.preset].items():
            if key not in explicit:
                setattr(model, key, value)
    return _family_problems(model, explicit, where, path)


def _family_problems(model: ModelArchConfig, explicit: set, where: Callable[[KeyPath], str], path: KeyPath) -> List[str]:
    """The family's fixed features set (a given key that contradicts them is an error) and every
    required field there."""
    file = where(path + ("preset",))
    if model.family not in FAMILIES:
        return [f"{located(where(path + ('family',)), dotted(path + ('family',)))}: unknown family "
                f"{model.family!r}; supported: {', '.join(FAMILIES)}"]
    conflicts = feature_conflicts(model, explicit)
    if conflicts:
        return [f"{located(where(path + (key,)), dotted(path + (key,)))}: {message}" for key, message in conflicts]
    for key, value in FAMILIES[model.family].fixed.items():
        setattr(model, key, value)
    missing = [k for k in REQUIRED_ARCH_FIELDS if getattr(model, k) is None]
    if missing:
        return [
            f"{file}: {dotted(path)}: missing {', '.join(missing)}; set them or name a preset "
            f"({', '.join(PRESETS)})"
        ]
    return []


# Keys only a role's entry (or its model file) has: a top file made of them is a role file.
_ROLE_KEYS = {f.name for f in dataclasses.fields(RewardRoleConfig)} - {"model_config_file"}


def read_checkpoint_meta(directory: str) -> Dict:
    """A converted checkpoint's CHECKPOINT_META_FILE, parsed (OSError or ValueError as open and
    json raise them): the one reader, for the config, the launcher and checkpoint/model_files.py."""
    with open(os.path.join(directory, CHECKPOINT_META_FILE), encoding="utf-8") as f:
        return json.load(f)


def _models_from_checkpoints(config: RLHFConfig) -> List[str]:
    """Each role's ``model: {preset: auto}``: the architecture written with the checkpoint it
    starts from (its ``load``, else that of the trained role whose weights it serves), for every
    key its files do not set."""
    problems, fields = [], {f.name for f in dataclasses.fields(ModelArchConfig)} - {"preset"}
    for role in config.model_roles:  # a function reward, a critic-free run's value roles: nothing to build
        model = config.role(role).model
        if model.preset != AUTO:
            continue
        config.refused.append(f"{role}.model")  # until its architecture is complete: no second report
        owner = role if config.role(role).load else SERVED_WEIGHTS.get(role, role)
        path, at = config.path_of(owner + ".load"), config.at(f"{role}.model.preset")
        missing = f"{owner}.load is not set" if path is None else f"{path} has no {CHECKPOINT_META_FILE}"
        try:
            arch = read_checkpoint_meta(path)["arch"] if path is not None else None
        except FileNotFoundError:
            arch = None
        except (OSError, ValueError, KeyError) as e:
            problems.append(f"{at}: {AUTO}: {path}/{CHECKPOINT_META_FILE} cannot be read ({e})")
            continue
        if arch is None:
            problems.append(f"{at}: {AUTO} takes the architecture from {owner}.load's converted checkpoint, but "
                            f"{missing}; convert it (tools/convert_hf_to_megatron.py) or name a preset ({', '.join(PRESETS)})")
            continue
        prefix = f"{role}.model."
        explicit = {k[len(prefix):] for k in config.origin if k.startswith(prefix)} - {"preset"}
        for key, value in arch.items():
            if key in fields and key not in explicit:
                setattr(model, key, value)
        found = _family_problems(model, explicit, lambda p: config.source_of(dotted(p)), (role, "model"))
        problems += found
        if not found:
            config.refused.remove(f"{role}.model")
    return problems


def override_tree(overrides: Sequence[str]) -> Tuple[Dict, Sources]:
    """``key=value`` arguments (dotted keys; a value typed as an environment variable's, or a YAML
    list or mapping: ``ppo.kl_coef=0.05``, ``rollout.stop=[a, b]``) as a tree to merge over the
    files', each leaf's source the command line."""
    tree: Dict = {}
    mapped: set = set()
    for text in overrides:
        key, sep, value = text.partition("=")
        path = tuple(key.strip().split("."))
        if not sep or not all(path):
            raise ConfigError(f"{COMMAND_LINE}: {text!r}: expected KEY=VALUE with a dotted key, e.g. ppo.kl_coef=0.05")
        try:  # a mapping or list as YAML; a scalar as an environment variable's text is typed
            parsed = yaml.load(value, Loader=_YamlLoader) if value.strip()[:1] in ("[", "{") else parse_scalar(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"{COMMAND_LINE}: {key}: the value {value!r} is not valid YAML ({e})") from None
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{COMMAND_LINE}: {key}: {'.'.join(path[:-1])} is given a value of its own too")
        _put_override(node, path, parsed, mapped)
    sources: Sources = {}
    return _interpolate_tree(tree, COMMAND_LINE, (), sources), sources


def _put_override(node: Dict, path: KeyPath, value, mapped: set, in_mapping: bool = False) -> None:
    """``value`` at ``path``'s last key of ``node``: a mapping where a mapping was given updates it key
    by key (``ppo.kl_coef=0.2 ppo={clip_ratio: 0.3}`` keeps both); a key that a dotted key and a
    mapping give two values is refused (two dotted keys: the later wins); ``mapped``: the paths a
    mapping set."""
    last = path[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        for key, item in value.items():
            _put_override(node[last], path + (key,), item, mapped, True)
        return
    if last in node and node[last] != value and (in_mapping or path in mapped):
        raise ConfigError(f"{COMMAND_LINE}: {'.'.join(path)} is given two values ({node[last]!r}, then {value!r}), "
                          "one of them inside a mapping; give it once")
    node[last] = value
    if in_mapping or isinstance(value, dict):
        mapped.update(_leaf_paths(value, path))


def _leaf_paths(value, path: KeyPath) -> List[KeyPath]:
    if not isinstance(value, dict):
        return [path]
    return [leaf for key, item in value.items() for leaf in _leaf_paths(item, path + (key,))]


def read_config(file: str, overrides: Sequence[str] = ()) -> Tuple[RLHFConfig, List[str]]:
    """The top config file as typed objects, with ``overrides`` (``key=value`` of the command line)
    over it, without the cross-key checks, and the problems found building it (unknown keys, wrong
    types; such keys keep their defaults). Raises ConfigError only for a file that cannot be read
    at all."""
    tree, sources = load_tree(file)
    if overrides:
        over, over_sources = override_tree(overrides)
        _merge(tree, sources, over, over_sources, ())
    role_keys = sorted(k for k in tree if k in _ROLE_KEYS)
    if role_keys and not any(r in tree for r in ROLE_NAMES):
        raise ConfigError(f"{file}: sets {', '.join(role_keys)}, which belong to one role: this is a role's model "
                          "file, not a top config; pass the file that names the roles (policy:, reference:, ...), "
                          "for example the rlhf.yaml that uses it")
    _attach_role_model_files(tree, sources)
    problems: List[str] = []
    refused: List[str] = []
    config = build(RLHFConfig, tree, sources, (), os.path.abspath(file), problems, refused)
    config.refused = refused
    config.origin = {dotted(p): f for p, f in sources.items()}
    config.origin[""] = os.path.abspath(file)
    problems += _models_from_checkpoints(config)
    if config.stage == "dpo":
        _reference_from_policy(config)
    return config, problems


# What DPO's reference takes from the policy unless its own keys say otherwise: its starting network.
REFERENCE_FROM_POLICY = ("model", "load", "precision")


def _reference_from_policy(config: RLHFConfig) -> None:
    """DPO's reference is the policy as it starts: each of REFERENCE_FROM_POLICY the reference's
    entry does not set is the policy's (with the file it came from, for paths and messages)."""
    for field in REFERENCE_FROM_POLICY:
        own = f"reference.{field}"
        if any(k == own or k.startswith(own + ".") for k in config.origin):
            continue
        setattr(config.reference, field, copy.deepcopy(getattr(config.policy, field)))
        theirs = f"policy.{field}"
        for key, file in list(config.origin.items()):
            if key == theirs or key.startswith(theirs + "."):
                config.origin["reference" + key[len("policy"):]] = file


def load_config(file: str, world_size: Optional[int] = None, check_inputs: bool = True,
                overrides: Sequence[str] = ()) -> RLHFConfig:
    """Load and validate the top config file with ``overrides`` (``key=value``) over it (see
    validation.py for the checks); ``check_inputs`` False skips the checks that the files it names
    exist (a dry run on another machine). Every problem is reported at once, in one ConfigError."""
    config, problems = read_config(file, overrides)
    if problems:
        # The cross-key checks still run (on defaults where a key was refused): one report of all.
        problems += [p for p in layout_problems(config, world_size) if p not in problems]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    validate(config, world_size, check_inputs)
    return config
