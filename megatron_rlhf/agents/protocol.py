"""The environment protocol: what answers the policy between its turns (a game, a tool, a judge).

``rollout.environment: module:Class`` or ``path/to/file.py:Class`` (relative to the config file
that names it), like a reward function. One instance per trajectory, made with no arguments, in an
environment worker process (rollout/env_pool.py):

    class MyEnvironment:
        def start(self, row: dict) -> Observation:
            '''row: the data row ("prompt" and its other columns: ground_truth, ...). The first
            observation, shown before the model's first turn: None (the prompt alone), a string
            (a user message, or plain text without a chat template) or a list of chat messages.'''
        def step(self, turn: Turn) -> StepResult | tuple:
            '''The model's turn -> (observation, done, reward, info): the reply to show the model
            (as for start; None when done), whether the trajectory ends, a per-turn reward (a
            number or None; added to the trajectory's score) and a dict of anything else.'''

A step's ``info`` may carry ``counts``: {name: number}, names starting with ``tool_`` or
``env_``; they are added over the batch into the metrics as ``rollout/<name>`` (``time/<name>``
for a name ending in ``_s``). Each call is bounded by ``rollout.env_timeout_s``. A call that raises, times out or returns what
the protocol does not allow ends its trajectory as a counted failure with the reason; the run goes
on unless every trajectory of a batch fails.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Dict, List, Optional, Union

from megatron_rlhf.config.names import CHAT_ROLES

Messages = List[Dict[str, str]]
Observation = Union[None, str, Messages]
COUNT_PREFIXES = ("tool_", "env_")  # an environment's own counts (info["counts"]), summed into rollout/<name>


@dataclasses.dataclass
class Turn:
    """The model's turn as the environment sees it: its text, its token ids, the turn's index
    (0 for the first), and whether it ended at an end token (False: at the per-turn limit)."""

    text: str
    token_ids: List[int]
    index: int
    ended: bool


@dataclasses.dataclass
class StepResult:
    observation: Observation = None
    done: bool = False
    reward: Optional[float] = None
    info: Dict[str, Any] = dataclasses.field(default_factory=dict)


class ProtocolError(Exception):
    """What an environment returned breaks the protocol (the trajectory fails, counted)."""


def checked_observation(value: Any) -> Observation:
    """``value`` if it is an observation the protocol allows, else ProtocolError saying why."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        for m in value:
            if m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
                raise ProtocolError(f"returned the message {m!r:.80}; a message is {{'role': one of {CHAT_ROLES}, "
                                    "'content': a string}")
        return value
    raise ProtocolError(f"returned the observation {type(value).__name__} {value!r:.60}; an observation is None, "
                        "a string or a list of chat messages")


def _finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def checked_step(value: Any) -> StepResult:
    """A step's result (a StepResult or an (observation, done, reward, info) tuple) checked."""
    if isinstance(value, tuple):
        if len(value) != 4:
            raise ProtocolError(f"step returned a tuple of {len(value)}; expected (observation, done, reward, info)")
        value = StepResult(*value)
    if not isinstance(value, StepResult):
        raise ProtocolError(f"step returned {type(value).__name__}; expected (observation, done, reward, info) "
                            "or a StepResult")
    if not isinstance(value.done, bool):
        raise ProtocolError(f"step returned done={value.done!r:.40}; done is True or False")
    reward = value.reward
    if reward is not None and not _finite_number(reward):
        raise ProtocolError(f"step returned reward={reward!r:.40}; a per-turn reward is a finite number or None")
    if not isinstance(value.info, dict):
        raise ProtocolError(f"step returned info={value.info!r:.40}; info is a dict")
    counts = value.info.get("counts", {})
    if not isinstance(counts, dict) or not all(
            isinstance(k, str) and k.startswith(COUNT_PREFIXES) and _finite_number(v) for k, v in counts.items()):
        raise ProtocolError(f"step returned info['counts']={counts!r:.80}; counts map names that start with "
                            f"{' or '.join(COUNT_PREFIXES)} to finite numbers")
    return StepResult(checked_observation(value.observation), value.done,
                      None if reward is None else float(reward), value.info)


def environment_spec(config) -> str:
    """``rollout.environment`` with a file path made absolute against the config file that names
    it; the class is imported here once, so a missing or broken one stops the run before start-up."""
    from megatron_rlhf.rewards.contract import absolute_spec, load_reward_function

    base = config.base_dir_of("rollout.environment")
    spec = absolute_spec(config.rollout.environment, base)
    cls = load_reward_function(spec, base, what="environment")
    missing = [m for m in ("start", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {spec!r}: has no {' or '.join(missing)} method; see agents/protocol.py")
    check_constructible(cls, {}, spec)
    return spec


def check_constructible(cls, options: Dict[str, Any], spec: str) -> None:
    """Refuse an environment class that cannot be made with ``options`` (a required argument):
    found here, not when every trajectory of the first batch fails."""
    import inspect

    try:
        inspect.signature(cls).bind(**options)
    except TypeError as e:
        given = f"with {', '.join(options)}" if options else "with no arguments"
        raise ValueError(f"environment {spec!r}: one instance per trajectory is made {given}, but {e}") from None
    except ValueError:  # no signature to read (a C type): made as it is
        pass
