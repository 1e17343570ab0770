"""Preference pairs (JSONL or Parquet): per row a prompt and two responses, the labellers' ``chosen``
and ``rejected``, and an optional ``margin`` (how much better chosen is; the Bradley-Terry loss
subtracts it). The shapes the public sets ship, each read as a prompt and two responses:

- ``prompt`` (a string or chat messages) with ``chosen`` / ``rejected`` as strings or as the
  assistant's messages;
- ``chosen`` / ``rejected`` as whole conversations that repeat the prompt (UltraFeedback-binarized:
  ``prompt`` a string, each side [user, assistant]), the shared start taken off;
- no ``prompt``: the conversations' (or texts', HH-RLHF) common start is the prompt (texts: up to
  the word they part in, its leading spaces going to the responses); a row without ``prompt`` but
  with another text column is refused (the prompt under another name).

Every row is read, encoded (data/exchanges.py) and cut to ``max_length`` when the file is opened,
so a bad row stops the run before start-up, named by file and line (JSONL) or row (Parquet).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

from megatron_rlhf.data.exchanges import Encoded, check_response, cut_to, encode_exchange, read_encoded, shown
from megatron_rlhf.data.rows import as_messages, check_prompt
from megatron_rlhf.data.tokenizer import Tokenizer

SIDES = ("chosen", "rejected")


@dataclasses.dataclass
class Pair:
    chosen: Encoded
    rejected: Encoded
    margin: float = 0.0


def _common_start(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _text_split(text: str, shared: int) -> int:
    """Where a prompt taken from two texts' shared start ends: before the word they part in (a cut
    inside a word would give each side half of it), and before the spaces that lead into it, which
    go to the responses (HH-RLHF's "Assistant: " prompt: a response starts " Sure" as the model
    writes it after "Assistant:", not "Sure"; TRL moves the space likewise)."""
    if shared < len(text):
        while shared and not text[shared - 1].isspace():
            shared -= 1
    while shared and text[shared - 1] == " ":
        shared -= 1
    return shared


def _refuse_other_prompt_columns(row: Dict[str, Any], where: str) -> None:
    """A row without 'prompt' takes its prompt from its sides' shared start; text in another column
    is most likely the prompt under another name, which would be silently dropped."""
    texts = [k for k, v in row.items() if k not in SIDES and k != "margin" and (isinstance(v, str) or (
        isinstance(v, list) and v and all(isinstance(m, dict) and "content" in m for m in v)))]
    if texts:
        raise ValueError(f"{where}: no 'prompt' column, but {', '.join(map(repr, texts))} holds text: a pair's prompt is "
                         "read from 'prompt', or without one taken from where 'chosen' and 'rejected' part; rename "
                         "the prompt's column to 'prompt', or drop the column if it is not the prompt")


def split_pair(row: Dict[str, Any], where: str) -> Tuple[Any, Any, Any]:
    """(prompt, chosen response, rejected response) of a row in any of the shapes above."""
    missing = [k for k in SIDES if k not in row]
    if missing:
        raise ValueError(f"{where}: no {' or '.join(map(repr, missing))} column; a preference row has 'chosen' and "
                         f"'rejected' (and 'prompt', unless both sides repeat it); columns: {', '.join(sorted(row))}")
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ValueError(f"{where}: 'chosen' and 'rejected' must both be text or both be chat messages, got "
                         f"{shown(chosen)} and {shown(rejected)}")
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, str):
            check_prompt(value, key, where)  # a list of well-formed messages
    if prompt is not None:
        check_prompt(prompt, "prompt", where)
        if not isinstance(chosen, str):  # whole conversations repeating the prompt lose it
            start = as_messages(prompt, "user")
            repeats = [side[: len(start)] == start for side in (chosen, rejected)]
            if all(repeats):
                chosen, rejected = chosen[len(start):], rejected[len(start):]
            elif any(repeats):
                raise ValueError(f"{where}: the conversations' prompts differ: one side repeats the row's prompt and "
                                 "the other does not")
    else:
        _refuse_other_prompt_columns(row, where)
        shared = _common_start(chosen, rejected)
        if isinstance(chosen, str):  # HH-RLHF's texts: the prompt ends where they part
            shared = _text_split(chosen, shared)
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            if not prompt.strip():
                raise ValueError(f"{where}: no 'prompt' column, and 'chosen' and 'rejected' share no text to take as it")
        else:
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            if not prompt or (chosen and chosen[0]["role"] != "assistant") or (rejected and rejected[0]["role"] != "assistant"):
                raise ValueError(f"{where}: the conversations' prompts differ (no 'prompt' column, and 'chosen' and "
                                 "'rejected' do not share their messages up to the assistant's answers)")
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        check_response(value, key, where)
    if chosen == rejected:
        raise ValueError(f"{where}: 'chosen' and 'rejected' are the same response; a pair needs two different answers")
    return prompt, chosen, rejected


def _margin(row: Dict[str, Any], where: str) -> float:
    value = row.get("margin", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: 'margin' must be a finite number, got {shown(value)}")
    return float(value)


class PreferencePairs:
    """Every pair of a file, encoded and cut: ``pairs[i]``, ``where(i)``; ``cut`` counts the pairs
    whose responses were shortened to ``max_length``."""

    def __init__(self, path: str, tokenizer: Tokenizer, max_length: int, chat: bool,
                 system_prompt: Optional[str] = None):
        def encode(row, where: str) -> Pair:
            prompt, chosen, rejected = split_pair(row, where)
            c, r = (cut_to(encode_exchange(tokenizer, prompt, response, chat, max_length, system_prompt), max_length,
                          where)
                    for response in (chosen, rejected))
            if c.ids == r.ids:
                raise ValueError(f"{where}: 'chosen' and 'rejected' are the same in their first {max_length} tokens "
                                 "(max_length): the pair would teach nothing; raise max_length or drop the row")
            return Pair(c, r, _margin(row, where))

        self.path = path
        self.file, self.pairs = read_encoded(path, encode)
        self.cut = sum(p.chosen.cut or p.rejected.cut for p in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def where(self, index: int) -> str:
        return self.file.where(index)
