"""Built-in verifiable rewards, each a reward function of the contract (rewards/contract.py):
``reward.function: megatron_rlhf.rewards.verifiers:gsm8k`` (or ``math``, ``answer_format``).

- ``gsm8k``: 1.0 when the number after the response's last ``#### `` equals the row's
  ``ground_truth`` (commas, a dollar sign and a trailing period ignored), else 0.0.
- ``math``: 1.0 when the response's final answer (its last ``\\boxed{...}``, else what math-verify
  extracts) is mathematically equal to ``ground_truth`` (math-verify: equivalent fractions,
  expressions, sets, intervals), else 0.0.
- ``answer_format``: 1.0 when the response states a final answer the way the verifiers read it
  (``#### N`` or ``\\boxed{...}``), else 0.0; a small weight of it rewards the format early on.

A ``ground_truth`` that is a list (or tuple) means any of its answers is right.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import List, Optional, Sequence

_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def _normalise_number(text: str) -> Optional[Decimal]:
    """The number ``text`` writes, exactly (a decimal, so that two long numbers that differ are never
    the same float), or None for text that is no finite number."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def gsm8k_answer(response: str) -> Optional[Decimal]:
    """The number after the last ``####`` of a response, normalised, or None."""
    found = _GSM8K_ANSWER.findall(response)
    return _normalise_number(found[-1]) if found else None


def answers(truth) -> List[str]:
    """The right answers a ground truth names: a list (or tuple) means any of them."""
    return [str(t) for t in truth] if isinstance(truth, (list, tuple)) else [str(truth)]


def gsm8k(prompts: List[str], responses: List[str], ground_truth: Sequence) -> List[float]:
    out = []
    for response, truth in zip(responses, ground_truth):
        answer = gsm8k_answer(response)
        right = answer is not None and any(answer == _normalise_number(t) for t in answers(truth))
        out.append(1.0 if right else 0.0)
    return out


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def math_equal(response: str, truth: str) -> bool:
    """Whether the response's final answer equals ``truth`` (math-verify). Its own signal-based
    time-outs are off: the reward pool bounds every call (and says so once, not per call)."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)

    boxed = last_boxed(response)
    answer = parse(f"${boxed}$" if boxed is not None else response, parsing_timeout=None)
    expected = parse(truth if "$" in truth or "\\boxed" in truth else f"${truth}$", parsing_timeout=None)
    return bool(answer) and bool(expected) and verify(expected, answer, timeout_seconds=None)


def math(prompts: List[str], responses: List[str], ground_truth: Sequence) -> List[float]:
    return [1.0 if any(math_equal(r, t) for t in answers(truth)) else 0.0 for r, truth in zip(responses, ground_truth)]


def answer_format(prompts: List[str], responses: List[str]) -> List[float]:
    return [1.0 if gsm8k_answer(r) is not None or last_boxed(r) is not None else 0.0 for r in responses]
