"""Rule rewards: ``reward.type: function`` with ``reward.function: module:callable`` or
``path/to/file.py:callable`` (relative to the config file that names it)."""

from __future__ import annotations

import importlib
import importlib.util
import numbers
import os
import traceback
from typing import Callable, List, Optional, Sequence

import torch

from megatron_rlhf.errors import NonFiniteError, RewardFunctionError

RewardFunction = Callable[[List[str], List[str]], Sequence[float]]


def load_reward_function(spec: str, base_dir: str) -> RewardFunction:
    """Import the callable named by ``spec``; errors name the spec and what is missing, and a
    file that does not import names its own file and line."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"reward.function: expected 'module:callable' or 'file.py:callable', got {spec!r}")
    try:
        if target.endswith(".py"):
            path = target if os.path.isabs(target) else os.path.join(base_dir, target)
            if not os.path.isfile(path):
                raise ValueError(f"reward.function {spec!r}: no file {path}")
            module_spec = importlib.util.spec_from_file_location(f"reward_{abs(hash(path))}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ValueError:
        raise
    except SyntaxError as e:
        raise ValueError(f"reward.function {spec!r}: {e.filename}:{e.lineno}: syntax error: {e.msg}") from None
    except ImportError as e:
        raise ValueError(f"reward.function {spec!r}: cannot import {target} ({e})") from None
    except Exception as e:  # the user's module failed while it was imported
        raise ValueError(f"reward.function {spec!r}: importing it raised {_describe(e)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.function {spec!r}: {target} has no callable {attr!r}")
    return fn


def _describe(error: BaseException) -> str:
    """``Type: message at file:line`` of the innermost frame of the user's code (not ours)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_OWN_CODE)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


_OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _name(fn: RewardFunction) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def score_with_function(fn: RewardFunction, prompts: List[str], responses: List[str]) -> torch.Tensor:
    """[B] float32 scores. The contract: ``fn(prompts, responses)`` returns a sequence of one real
    number (int or float, not str or bool) per response. A breach or an exception raises
    RewardFunctionError naming the function, what came back (or the user's frame) and, where one
    response is to blame, its index."""
    try:
        out = fn(prompts, responses)
    except Exception as e:
        index = _first_failing(fn, prompts, responses)
        at = f" on response {index} (prompt {prompts[index]!r})" if index is not None else ""
        raise RewardFunctionError(f"reward function {_name(fn)} raised {_describe(e)}{at}") from None
    expected = f"expected a list of {len(responses)} numbers, one per response"
    if out is None or isinstance(out, (str, bytes, int, float)) or not hasattr(out, "__len__"):
        raise RewardFunctionError(f"reward function {_name(fn)} returned {type(out).__name__} {out!r:.80}; {expected}")
    values = list(out.tolist() if hasattr(out, "tolist") else out)
    if len(values) != len(responses):
        raise RewardFunctionError(f"reward function {_name(fn)} returned {len(values)} values for {len(responses)} "
                                  f"responses; {expected}")
    for i, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise RewardFunctionError(f"reward function {_name(fn)} returned {type(x).__name__} {x!r:.40} for response "
                                      f"{i}; {expected} (convert strings with float() in the function if you mean them)")
    return torch.tensor([float(x) for x in values], dtype=torch.float32)


def _first_failing(fn: RewardFunction, prompts: List[str], responses: List[str]) -> Optional[int]:
    """The first response the function fails on alone (None if it fails on none alone)."""
    for i, (p, r) in enumerate(zip(prompts, responses)):
        try:
            fn([p], [r])
        except Exception:
            return i
    return None


def check_scores(scores: torch.Tensor, bound: float, iteration: int, prompts: Sequence[str]) -> None:
    """Stop on a score that is not finite or beyond +-bound (reward.max_abs_score), naming it."""
    bad = ~torch.isfinite(scores) | (scores.abs() > bound)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise NonFiniteError(
            f"iteration {iteration}: the reward gave {scores[i].item():.6g} for response {i} (prompt {prompts[i]!r:.60}), "
            f"{int(bad.sum())} of {len(scores)} beyond +-{bound:g} or not finite; fix the reward, or raise "
            "reward.max_abs_score if such scores are meant")
