"""An LLM judge's text, both ways: its prompt from a template, and its verdicts as scores (the judge
section; rollout/judging.py runs the judge). Pure Python, registered by name (config/names.py).

Parsers (``judge.parser``), each ``verdict -> score or None`` (None: unparsed, scored
``judge.unparsed_score`` and counted):

- ``number``: the verdict's first number (``7``, ``-1.5``, ``8/10`` reads 8), kept if within ``score_range``.
- ``boxed``: the number inside its last ``\\boxed{}``, within ``score_range`` (a reasoning judge).
- ``choice``: the first of ``choices``' words the verdict says as a word of its own (``A`` in
  "A is better" but not in "Alice"), scored as ``choices`` maps it (pairwise A/B against a reference).
- ``function``: the user's ``parser_function``, a reward function run in the reward pool's workers
  (time-outs, failures named), NaN for a verdict it cannot read (rollout/judging.py calls it).

Combinations (``judge.combine``) of a response's verdicts' scores (unparsed ones at their default):
``mean``, ``majority`` (the most frequent score; a tie goes to the lower), ``min``, ``max``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable, Dict, List, Optional, Sequence

from megatron_rlhf.config.names import JUDGE_COMBINES, JUDGE_FIELD_PATTERN, JUDGE_PARSERS, registry
from megatron_rlhf.rewards.verifiers import last_boxed

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FIELD = re.compile(JUDGE_FIELD_PATTERN)

Parser = Callable[[str], Optional[float]]


def fill_template(template: str, prompt: str, response: str, reference: str) -> str:
    """``template`` with its {prompt}, {response} and {reference} replaced (in one pass: a response
    that writes "{prompt}" stays as written); every other brace is text."""
    values = {"prompt": prompt, "response": response, "reference": reference}
    return _FIELD.sub(lambda m: values[m.group(1)], template)


def _in_range(value: Optional[float], low: float, high: float) -> Optional[float]:
    return value if value is not None and low <= value <= high else None


def _first_number(text: str) -> Optional[float]:
    found = _NUMBER.search(text)
    return float(found.group()) if found else None


def number_parser(low: float, high: float) -> Parser:
    return lambda verdict: _in_range(_first_number(verdict), low, high)


def boxed_parser(low: float, high: float) -> Parser:
    def parse(verdict: str) -> Optional[float]:
        boxed = last_boxed(verdict)
        return None if boxed is None else _in_range(_first_number(boxed), low, high)

    return parse


def choice_parser(choices: Dict[str, float]) -> Parser:
    words = sorted(choices, key=len, reverse=True)  # "AB" before "A" where both are choices
    pattern = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, words)) + r")(?!\w)")

    def parse(verdict: str) -> Optional[float]:
        found = pattern.search(verdict)
        return float(choices[found.group(1)]) if found else None

    return parse


PARSERS = registry(JUDGE_PARSERS, "judge.parser", {
    "number": lambda judge: number_parser(*judge.score_range),
    "boxed": lambda judge: boxed_parser(*judge.score_range),
    "choice": lambda judge: choice_parser(judge.choices),
    "function": lambda judge: None,  # the user's, run in the reward pool's workers (rollout/judging.py)
})


def parser_of(judge) -> Optional[Parser]:
    """The parser a judge section (config.schema.JudgeRoleConfig) names, with its range or choices
    (None for a parser function: the reward pool calls it)."""
    return PARSERS[judge.parser](judge)


def _majority(scores: Sequence[float]) -> float:
    counts = Counter(scores)
    return min(counts, key=lambda s: (-counts[s], s))


COMBINES = registry(JUDGE_COMBINES, "judge.combine", {
    "mean": lambda scores: sum(scores) / len(scores),
    "majority": _majority,
    "min": min,
    "max": max,
})


def combined(scores: List[Optional[float]], samples: int, combine: str, default: float) -> List[float]:
    """Per response, its ``samples`` consecutive verdicts' scores combined (``default`` for an unparsed one)."""
    rule = COMBINES[combine]
    filled = [default if s is None else s for s in scores]
    return [rule(filled[i : i + samples]) for i in range(0, len(filled), samples)]
