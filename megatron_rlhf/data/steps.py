"""Stepwise rows for process reward models (JSONL or Parquet), one solution per row, in one of the two
shapes the public sets ship:

- TRL's stepwise supervision: ``prompt`` (a string), ``completions`` (the steps, strings) and
  ``labels`` (one per step: true/false or 1/0, whether the step is right);
- Math-Shepherd's: ``input``, the question and its steps with the tag ``ки`` after each step, and
  ``label``, the same text with ``+`` (right) or ``-`` (wrong) in place of each tag. The question
  ends where the first step starts (``Step 1:``, either case, else after the first ``?``), as TRL's
  conversion of the set reads it.

A row is encoded as TRL's PRMTrainer encodes it: the prompt as the tokenizer encodes a prompt (its
BOS), then each step's text followed by ``step_separator``; a step's label sits on its separator's
last token, the only positions scored. Every row is read and checked when the file is opened: a bad
one stops the run before start-up, named by file and line (or row). A row longer than ``max_length``
keeps its first tokens (steps whose separator falls beyond lose their labels: trained on its last
step only, such a row trains on nothing, as in TRL); a prompt is never cut.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Tuple

from megatron_rlhf.data.exchanges import read_encoded, shown, within_length
from megatron_rlhf.data.rows import check_prompt
from megatron_rlhf.data.tokenizer import Tokenizer

SHEPHERD_TAG = "ки"
_FIRST_STEP = re.compile(r"[Ss]tep 1:")
NO_LABEL = -1  # a position that is not a step's end


@dataclasses.dataclass
class Steps:
    """One encoded solution: ``ids`` (prompt, then each step and its separator), ``labels`` (per id:
    1 or 0 at a step's end, NO_LABEL elsewhere), ``prompt_length`` and whether it was cut."""

    ids: List[int]
    labels: List[int]
    prompt_length: int
    cut: bool = False
    last_step_kept: bool = True  # whether the solution's last step ends within the length limit

    @property
    def steps(self) -> int:
        return sum(label != NO_LABEL for label in self.labels)


def _label(value: Any, index: int, where: str) -> int:
    if isinstance(value, bool) or value in (0, 1):
        return int(value)
    raise ValueError(f"{where}: 'labels' item {index} must be true/false or 1/0 (is step {index + 1} right), got "
                     f"{shown(value)}")


def trl_steps(row: Dict[str, Any], where: str) -> Tuple[str, List[str], List[int]]:
    """(prompt, steps, labels) of a row of TRL's stepwise format."""
    missing = [k for k in ("prompt", "completions", "labels") if k not in row]
    if missing:
        raise ValueError(f"{where}: no {' or '.join(map(repr, missing))} column; a stepwise row is a 'prompt', its "
                         f"steps in 'completions' and a label per step in 'labels' (or Math-Shepherd's 'input' and "
                         f"'label'); columns: {', '.join(sorted(row))}")
    prompt, steps, labels = row["prompt"], row["completions"], row["labels"]
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string (stage prm reads text), got {shown(prompt)}")
    check_prompt(prompt, "prompt", where)
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) and s.strip() for s in steps):
        raise ValueError(f"{where}: 'completions' must be a list of the steps' texts, none empty, got {shown(steps)}")
    if not isinstance(labels, list) or len(labels) != len(steps):
        raise ValueError(f"{where}: 'labels' must hold one label per step ({len(steps)} steps), got {shown(labels)}")
    return prompt, steps, [_label(v, i, where) for i, v in enumerate(labels)]


def shepherd_steps(row: Dict[str, Any], where: str) -> Tuple[str, List[str], List[int]]:
    """(prompt, steps, labels) of a Math-Shepherd row: its ``input`` cut at each tag, each tag's label
    the ``label`` text's character at the tag's place (+ right, - wrong)."""
    text, marked = row["input"], row.get("label")
    if not isinstance(text, str) or not isinstance(marked, str):
        raise ValueError(f"{where}: Math-Shepherd's 'input' and 'label' must both be text, got {shown(text)} and "
                         f"{shown(marked)}")
    single = text.replace(SHEPHERD_TAG, "\0")  # one character per tag, as 'label' has one sign per tag
    places = [i for i, c in enumerate(single) if c == "\0"]
    if not places:
        raise ValueError(f"{where}: 'input' has no step tag {SHEPHERD_TAG!r}: no step to score")
    if len(marked) != len(single) or any(marked[i] not in "+-" for i in places):
        raise ValueError(f"{where}: 'label' must be 'input' with '+' or '-' in place of each {SHEPHERD_TAG!r}")
    head, *between, _after_last = single.split("\0")  # text after the last tag has no label (TRL drops it)
    first = _FIRST_STEP.search(head)
    cut = first.start() if first else (head.find("?") + 1 or None)
    if not cut:
        raise ValueError(f"{where}: the question and the first step cannot be told apart (no 'Step 1:' and no '?' "
                         "before the first tag)")
    prompt, steps = head[:cut].strip(), [head[cut:].strip()] + [p.strip() for p in between]
    if not prompt or not all(steps):
        raise ValueError(f"{where}: an empty question or step between the tags")
    return prompt, steps, [int(marked[i] == "+") for i in places]


def encode_steps(tokenizer: Tokenizer, prompt: str, steps: List[str], labels: List[int], separator: str) -> Steps:
    ids = list(tokenizer.encode_prompt(prompt, chat=False))
    prompt_length = len(ids)
    marks = [NO_LABEL] * prompt_length
    separator_ids = tokenizer.encode_text(separator)
    for step, label in zip(steps, labels):
        step_ids = tokenizer.encode_text(step) + separator_ids
        ids += step_ids
        marks += [NO_LABEL] * (len(step_ids) - 1) + [label]
    return Steps(ids, marks, prompt_length)


class StepRows:
    """Every stepwise row of a file, encoded and cut: ``rows[i]`` (Steps), ``where(i)``; ``cut``
    counts the rows shortened to ``max_length``."""

    def __init__(self, path: str, tokenizer: Tokenizer, max_length: int, separator: str):
        if not tokenizer.encode_text(separator):
            raise ValueError(f"prm.step_separator {separator!r} encodes to no token")

        def encode(row: Dict[str, Any], where: str) -> Steps:
            prompt, steps, labels = (shepherd_steps if "input" in row and "completions" not in row else trl_steps)(
                row, where)
            # a step far past the limit is cut before it is encoded (what is cut lies beyond it anyway)
            steps = [within_length(tokenizer, step, max_length) for step in steps]
            encoded = encode_steps(tokenizer, prompt, steps, labels, separator)
            if encoded.prompt_length >= max_length:
                raise ValueError(f"{where}: the prompt alone is {encoded.prompt_length} tokens, and max_length="
                                 f"{max_length} leaves no room for a step; raise max_length or drop the row")
            if len(encoded.ids) > max_length:
                encoded = Steps(encoded.ids[:max_length], encoded.labels[:max_length], encoded.prompt_length, cut=True,
                                last_step_kept=False)
            if not encoded.steps:
                raise ValueError(f"{where}: no step ends within max_length={max_length}; raise it or drop the row")
            return encoded

        self.path = path
        self.file, self.rows = read_encoded(path, encode)
        self.cut = sum(s.cut for s in self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, index: int) -> str:
        return self.file.where(index)
