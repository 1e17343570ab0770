"""Anchors: text a megatron-core file must still hold for the code that relies on it, checked at
start-up, and the two ways the project points megatron's names at its own for a block."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

CHECKED_MEGATRON_CORE_VERSIONS = ("0.16.1",)


class MegatronInternalsChanged(RuntimeError):
    """The installed megatron-core no longer matches the internals this project was written for."""


@dataclasses.dataclass(frozen=True)
class Site:
    """Text that must appear in a megatron-core file (relative to megatron/core), within the
    1-based inclusive line range ``lines`` when given, else anywhere in the file."""

    file: str
    anchor: str
    lines: Optional[Tuple[int, int]] = None


def megatron_core_dir() -> str:
    import megatron.core

    return os.path.dirname(megatron.core.__file__)


def site_problems(named_sites: Iterable[Tuple[str, Iterable[Site]]]) -> List[str]:
    """Every site whose anchor is no longer where it should be, as readable problems."""
    root = megatron_core_dir()
    problems: List[str] = []
    cache: Dict[str, List[str]] = {}
    for name, sites in named_sites:
        for site in sites:
            if site.file not in cache:
                try:
                    with open(os.path.join(root, site.file), encoding="utf-8") as f:
                        cache[site.file] = f.read().splitlines()
                except OSError as e:
                    problems.append(f"{name}: cannot read megatron/core/{site.file}: {e}")
                    cache[site.file] = []
                    continue
            lines = cache[site.file]
            first, last = site.lines or (1, len(lines))
            if site.anchor not in "\n".join(lines[first - 1 : last]):
                where = f" lines {first}-{last}" if site.lines else ""
                problems.append(f"{name}: expected {site.anchor!r} in megatron/core/{site.file}{where}")
    return problems


def raise_if_changed(problems: List[str], what: str, module: str) -> None:
    if problems:
        version = importlib.metadata.version("megatron-core")
        raise MegatronInternalsChanged(
            f"megatron-core {version} differs from the internals {what} were written for (checked: "
            f"{', '.join(CHECKED_MEGATRON_CORE_VERSIONS)}). Re-verify each in {module}:\n  "
            + "\n  ".join(problems)
        )


@contextlib.contextmanager
def names_replaced(module, **replacements):
    """Within the block, ``module``'s names point at ``replacements`` (functions megatron looks up
    in its module at call time); afterwards they are megatron's again."""
    saved = {name: getattr(module, name) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def methods_replaced(modules: List[torch.nn.Module], name: str, make: Callable[[int, torch.nn.Module], Callable]):
    """Within the block, module i's method ``name`` is ``make(i, module)`` (an attribute of the
    instance, which its class's method looks up at call time); afterwards the class's again."""
    try:
        for i, module in enumerate(modules):
            setattr(module, name, make(i, module))
        yield
    finally:
        for module in modules:
            module.__dict__.pop(name, None)
