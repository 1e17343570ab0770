"""The reward function contract: how a rule reward is named, loaded and called.

``reward.function: module:callable`` or ``path/to/file.py:callable`` (relative to the config file
that names it). A function is called as ``fn(prompts, responses, **fields)``: lists of equal
length (the pool calls it with one response at a time), ``fields`` being the row's other data
columns (``ground_truth``, ``data_source``, ...), of which it receives those its signature names
(all of them with ``**kwargs``). A function whose signature names ``completions`` is called as
TRL calls its reward functions, every argument by keyword: ``fn(prompts=..., completions=...,
**fields)`` (``prompts`` where it takes it). It returns one real number per response, or a mapping
of named sub-scores, each a list of one number per response, with the reward under ``"score"``;
the others are logged. As TRL allows: None for a response the function does not apply to (it then
adds nothing to the reward, and is counted: reward/not_applicable), numbers as 0-d tensors or
numpy scalars, and an ``async def`` function (awaited).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import numbers
import os
import traceback
from typing import Any, Callable, Dict, List, Optional

RewardFunction = Callable[..., Any]


class ContractError(Exception):
    """What a reward function returned breaks the contract (a bug in it, not a hard input)."""


def load_reward_function(spec: str, base_dir: str, what: str = "reward function") -> RewardFunction:
    """Import the callable named by ``spec`` (a reward function, or ``what`` else: an environment
    class); errors name the spec and what is missing, and a file that does not import names its
    own file and line."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{what}: expected 'module:callable' or 'file.py:callable', got {spec!r}")
    try:
        if target.endswith(".py"):
            path = target if os.path.isabs(target) else os.path.join(base_dir, target)
            if not os.path.isfile(path):
                raise ValueError(f"{what} {spec!r}: no file {path}")
            module_spec = importlib.util.spec_from_file_location(f"user_{abs(hash(path))}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ValueError:
        raise
    except SyntaxError as e:
        raise ValueError(f"{what} {spec!r}: {e.filename}:{e.lineno}: syntax error: {e.msg}") from None
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {target} ({e})") from None
    except Exception as e:  # the user's module failed while it was imported
        raise ValueError(f"{what} {spec!r}: importing it raised {describe(e)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} {spec!r}: {target} has no callable {attr!r}")
    return fn


_OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def describe(error: BaseException) -> str:
    """``Type: message at file:line`` of the innermost frame of the user's code (not ours)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_OWN_CODE)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


def accepted_fields(fn: RewardFunction, fields: Dict[str, Any]) -> Dict[str, Any]:
    """The fields ``fn``'s signature takes (all with **kwargs; none for a non-introspectable one)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return fields
    names = {p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return {k: v for k, v in fields.items() if k in names}


# TRL's names of what its trainers pass every reward function by keyword beside the data columns:
# the first two are passed here too, the others are not (a function that needs one is refused).
TRL_ARGUMENTS = ("prompts", "completions")
TRL_UNSUPPORTED = ("completion_ids", "trainer_state", "log_extra", "log_metric")


def _named(fn: RewardFunction) -> List[inspect.Parameter]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def by_keyword(fn: RewardFunction) -> bool:
    """Whether ``fn`` takes TRL's convention (a parameter named ``completions``: every argument
    by keyword) rather than ours (``prompts, responses`` by position)."""
    return any(p.name == "completions" for p in _named(fn))


def required_fields(fn: RewardFunction) -> List[str]:
    """The data columns ``fn`` cannot be called without: its parameters without a default after
    (prompts, responses), or, called by keyword, besides prompts and completions."""
    named = _named(fn)
    if by_keyword(fn):
        return [p.name for p in named if p.default is inspect.Parameter.empty and p.name not in TRL_ARGUMENTS]
    return [p.name for p in named[2:] if p.default is inspect.Parameter.empty]


def unsupported_arguments(fn: RewardFunction) -> List[str]:
    """TRL's arguments ``fn`` requires that no trainer here passes (TRL_UNSUPPORTED)."""
    return [name for name in required_fields(fn) if name in TRL_UNSUPPORTED] if by_keyword(fn) else []


def call(fn: RewardFunction, prompts: List[str], responses: List[str], fields: List[Dict[str, Any]]) -> List[Dict[str, float]]:
    """Per response, its named scores (``score`` first). Raises what ``fn`` raises, or
    ContractError for a result that breaks the contract."""
    columns = sorted({k for row in fields for k in row})
    keywords = accepted_fields(fn, {k: [row.get(k) for row in fields] for k in columns})
    if by_keyword(fn):  # TRL's convention
        out = fn(**accepted_fields(fn, {"prompts": prompts}), completions=responses,
                 **{k: v for k, v in keywords.items() if k not in TRL_ARGUMENTS})
    else:
        out = fn(prompts, responses, **keywords)
    if inspect.isawaitable(out):  # an async def reward function, as TRL awaits them
        out = asyncio.run(_awaited(out))
    n = len(responses)
    if isinstance(out, dict):
        if "score" not in out:
            raise ContractError(f"returned a mapping without 'score' (keys: {', '.join(map(str, out))}); the reward goes "
                                "under 'score', other keys are logged")
        named = {str(k): _numbers(v, n, f"[{k!r}]") for k, v in out.items()}
        names = ["score"] + [k for k in named if k != "score"]
        return [{k: named[k][i] for k in names} for i in range(n)]
    return [{"score": x} for x in _numbers(out, n, "")]


async def _awaited(awaitable):
    return await awaitable


def _numbers(out: Any, n: int, what: str) -> List[Optional[float]]:
    """The ``n`` numbers of a result (None where the function does not apply, TRL's convention)."""
    expected = f"expected a list of {n} numbers, one per response"
    if out is None or isinstance(out, (str, bytes, int, float)) or not hasattr(out, "__len__") \
            or getattr(out, "ndim", 1) == 0:
        raise ContractError(f"returned{what} {type(out).__name__} {out!r:.80}; {expected}")
    values = list(out.tolist() if hasattr(out, "tolist") else out)
    if len(values) != n:
        raise ContractError(f"returned{what} {len(values)} values for {n} responses; {expected}")
    numbers_ = []
    for x in values:
        if getattr(x, "ndim", None) == 0 and hasattr(x, "item"):  # a 0-d tensor or numpy scalar
            x = x.item()
        if x is not None and (isinstance(x, bool) or not isinstance(x, numbers.Real)):
            raise ContractError(f"returned{what} {type(x).__name__} {x!r:.40}; {expected} (or None where it does "
                                "not apply; convert strings with float() in the function if you mean them)")
        numbers_.append(None if x is None else float(x))
    return numbers_


def reward_functions(config) -> Dict[str, float]:
    """The configured rule rewards (``reward.function``, or ``reward.functions`` with their
    weights) as spec -> weight, a file path made absolute against the config file that names it;
    each is imported here once, so that a missing or broken one stops the run before start-up."""
    reward = config.reward
    key = "reward.function" if reward.functions is None else "reward.functions"
    specs = {reward.function: 1.0} if reward.functions is None else dict(reward.functions)
    resolved = {}
    for spec, weight in specs.items():
        base = config.base_dir_of(key if reward.functions is None else f"{key}.{spec}")  # each entry where it was set
        spec = absolute_spec(spec, base)
        load_reward_function(spec, base)
        resolved[spec] = weight
    return resolved


def absolute_spec(spec: str, base_dir: str) -> str:
    """``file.py:callable`` with the file made absolute against ``base_dir`` (worker processes run
    elsewhere); a module spec as it is."""
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py") and not os.path.isabs(target):
        return f"{os.path.join(base_dir, target)}:{attr}"
    return spec
