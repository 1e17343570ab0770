"""A trajectory as tokens: one append-only buffer per trajectory, token in and token out.

The model's tokens are appended exactly as sampled (loss mask 1); an environment's reply is
tokenised once, as what the chat template adds for the new message(s) after the model's turn (the
template's own boundary tokens included: Qwen's newline after ``<|im_end|>``, the next
``<|im_start|>assistant\\n``), and appended with loss mask 0. Nothing already in the buffer is
ever tokenised again, so the ids the model was trained on are the ids it produced.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_rlhf.agents.protocol import Messages, Observation

# A conversation that ends with an assistant turn: the fixed left context against which a reply's
# tokens are taken as a difference (the same for every template, so no real turn is re-rendered).
_BASE: Messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


class ObservationEncoder:
    """Turns an observation into the ids that follow the model's turn. ``tokenizer``: a
    data.tokenizer Tokenizer; ``chat``: whether prompts go through its chat template (else an
    observation's text is appended as it encodes, messages' contents one after another)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat
        if chat:
            base = self._render(_BASE, generation_prompt=False)
            opened = self._render(_BASE[:1], generation_prompt=True)
            answer = base[len(opened):]
            if not base.startswith(opened) or _BASE[1]["content"] not in answer:
                raise ValueError("the chat template does not render an assistant turn after its generation prompt; "
                                 "multi-turn rollouts need a template that does")
            self._base = base
            # What the template writes after an assistant message's content (its end token and boundary).
            self._closing = answer.partition(_BASE[1]["content"])[2]

    def _render(self, messages: Messages, generation_prompt: bool) -> str:
        return self.tokenizer.render_chat(messages, generation_prompt)

    def encode(self, observation: Observation, turn_ids: Sequence[int], eos_ids: Sequence[int]) -> List[int]:
        """The ids to append after a model turn ``turn_ids`` (which ended in one of ``eos_ids`` or
        not) for ``observation``: the rest of the template's closing of the assistant turn, the
        new message(s) and the next generation prompt; without a template, the text's ids."""
        if observation is None:
            return []
        if not self.chat:
            text = observation if isinstance(observation, str) else "".join(m["content"] for m in observation)
            return self.tokenizer.encode_text(text)
        messages = [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
        full = self._render(_BASE + messages, generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders earlier turns differently once a message follows them; "
                             "its reply tokens cannot be taken as a difference")
        closing = self.tokenizer.encode_text(self._closing)
        if turn_ids and closing and turn_ids[-1] == closing[0] and turn_ids[-1] in eos_ids:
            closing = closing[1:]  # the model wrote the end token itself
        return closing + self.tokenizer.encode_text(full[len(self._base):])


def start_call(prompt: str, fields: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """A trajectory's first call: its environment's start, with the prompt and the row's data
    columns (agents/protocol.py)."""
    return "start", {"prompt": prompt, **fields}


class Trajectory:
    """The token buffer of one trajectory: ``tokens`` (prompt first), ``mask`` (1 per model
    token, 0 per prompt or environment token), and what happened (turns, why it ended, rewards).
    For partial rollouts also the iteration each model token was sampled in (``versions``, -1
    elsewhere) and the environment calls it made (``calls``: made again to rebuild its
    environment when it resumes in another iteration) with what each answered (``answers``: a
    rebuilt environment must answer them alike)."""

    # What a trajectory held between iterations keeps (state / from_state): all but its pool id.
    _KEPT = ("tokens", "mask", "behaviour", "versions", "prompt_length", "turns", "done", "failure", "turn_rewards",
             "truncated_observations", "calls", "answers")

    def __init__(self, prompt_ids: Sequence[int], index: int, version: int = 0):
        self.tokens: List[int] = list(prompt_ids)
        self.mask: List[int] = [0] * len(prompt_ids)
        self.behaviour: List[float] = [0.0] * len(prompt_ids)  # the engine's log-prob of each model token
        self.versions: List[int] = [-1] * len(prompt_ids)
        self.version = version  # the iteration whose weights sample its next tokens
        self.prompt_length = len(prompt_ids)
        self.index = index  # the trajectory's id in the environment pool
        self.turns = 0
        self.turns_before = 0  # turns taken in earlier iterations (resumed)
        self.done = False
        self.failure: Optional[str] = None  # why the environment failed it (counted)
        self.turn_rewards: List[float] = []
        self.truncated_observations = 0
        self.calls: List[Tuple[str, Any]] = []  # (kind, payload) of every call made
        self.answers: List[list] = []  # [observation ids, done, reward] of each call answered
        self.replaying = 0  # calls still to be answered that rebuild its environment (resumed)

    def state(self) -> Dict[str, Any]:
        """What resumes it in another iteration (plain values, for the run's checkpoint)."""
        return {name: getattr(self, name) for name in self._KEPT}

    @classmethod
    def from_state(cls, state: Dict[str, Any], index: int, version: int) -> "Trajectory":
        t = cls([], index, version)
        for name in cls._KEPT:  # answers: none recorded by checkpoints written before they were
            setattr(t, name, copy.deepcopy(state[name] if name != "answers" else state.get(name, [])))
        t.turns_before = t.turns
        return t

    def append_model(self, ids: Sequence[int], log_probs: Optional[Sequence[float]] = None) -> None:
        self.tokens += ids
        self.mask += [1] * len(ids)
        self.behaviour += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.versions += [self.version] * len(ids)
        self.turns += 1

    def fitted_observation(self, ids: Sequence[int], limit: int) -> List[int]:
        """An environment's ids within ``limit``: more keep their first and last halves (the
        middle cut, counted), before any room is measured."""
        if len(ids) <= limit:
            return list(ids)
        self.truncated_observations += 1
        return list(ids[: limit - limit // 2]) + list(ids[len(ids) - limit // 2 :])

    def append_observation(self, ids: Sequence[int]) -> None:
        """Environment ids (fitted) with loss mask 0."""
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.behaviour += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def fail(self, reason: str) -> None:
        self.failure, self.done = reason, True
