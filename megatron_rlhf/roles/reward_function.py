"""Rule rewards: ``reward.type: function`` with ``reward.function: module:callable`` or
``path/to/file.py:callable`` (relative to the config file that names it)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable, List, Sequence

import torch

RewardFunction = Callable[[List[str], List[str]], Sequence[float]]


def load_reward_function(spec: str, base_dir: str) -> RewardFunction:
    """Import the callable named by ``spec``; errors name the spec and what is missing."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"reward.function: expected 'module:callable' or 'file.py:callable', got {spec!r}")
    if target.endswith(".py"):
        path = target if os.path.isabs(target) else os.path.join(base_dir, target)
        if not os.path.isfile(path):
            raise ValueError(f"reward.function {spec!r}: no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"reward_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"reward.function {spec!r}: cannot import {target} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.function {spec!r}: {target} has no callable {attr!r}")
    return fn


def score_with_function(fn: RewardFunction, prompts: List[str], responses: List[str]) -> torch.Tensor:
    """[B] float32 scores; the function must return one finite number per response."""
    out = fn(prompts, responses)
    scores = torch.as_tensor([float(x) for x in out], dtype=torch.float32)
    if scores.shape != (len(responses),) or not torch.isfinite(scores).all():
        raise ValueError(
            f"reward function returned {list(out)[:8]}...: expected {len(responses)} finite numbers, "
            "one per response"
        )
    return scores
