"""Name -> implementation tables of the RL math, each checked against the names a config may
choose (config/names.py) when the module that builds it is imported: an implementation without a
name, or a name without one, stops the import instead of failing a run."""

from __future__ import annotations

from typing import Dict, Sequence, TypeVar

T = TypeVar("T")


def registry(names: Sequence[str], key: str, implementations: Dict[str, T]) -> Dict[str, T]:
    """``implementations`` (name -> implementation), in the order of ``names``, if it implements
    exactly ``names`` (the domain of config key ``key``)."""
    missing, unknown = set(names) - set(implementations), set(implementations) - set(names)
    if missing or unknown:
        raise RuntimeError(f"{key}: the config's names {tuple(names)} and the implementations "
                           f"{tuple(implementations)} differ (missing {sorted(missing)}, unnamed {sorted(unknown)})")
    return {name: implementations[name] for name in names}
