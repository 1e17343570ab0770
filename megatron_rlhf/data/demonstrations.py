"""Demonstrations for supervised fine-tuning (JSONL or Parquet), one per row: a chat in ``messages``
(every assistant message trained, the rest read; needs the chat template), or a ``prompt`` and a
``completion`` (strings, or chat messages with the template; TRL's prompt-completion shape).
Every row is encoded and cut to ``max_length`` when the file is opened (data/exchanges.py): a bad
row stops the run before start-up, named by file and line or row.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from megatron_rlhf.data.exchanges import (Encoded, check_response, cut_to, encode_exchange, has_assistant_text,
                                          read_encoded, within_length)
from megatron_rlhf.data.rows import check_prompt, with_system_prompt
from megatron_rlhf.data.tokenizer import Tokenizer


def encode_demonstration(row: Dict[str, Any], tokenizer: Tokenizer, chat: bool, system_prompt: Optional[str],
                         max_length: int, where: str) -> Encoded:
    if "messages" in row:
        messages = row["messages"]
        check_prompt(messages, "messages", where)
        if not chat:
            raise ValueError(f"{where}: a chat in 'messages' needs data.apply_chat_template: true")
        if not has_assistant_text(messages):
            raise ValueError(f"{where}: 'messages' has no assistant message with text: nothing to learn from")
        ids, trained = tokenizer.encode_chat(within_length(tokenizer, list(with_system_prompt(messages, system_prompt)),
                                                           max_length))
        return Encoded(ids, trained, trained.index(1))
    missing = [k for k in ("prompt", "completion") if k not in row]
    if missing:
        raise ValueError(f"{where}: no {' or '.join(map(repr, missing))} column; a demonstration is a chat in "
                         f"'messages', or a 'prompt' and its 'completion'; columns: {', '.join(sorted(row))}")
    check_prompt(row["prompt"], "prompt", where)
    check_response(row["completion"], "completion", where)
    return encode_exchange(tokenizer, row["prompt"], row["completion"], chat, max_length, system_prompt)


class Demonstrations:
    """Every demonstration of a file, encoded and cut: ``rows[i]`` (Encoded), ``where(i)``;
    ``cut`` counts those whose responses were shortened to ``max_length``."""

    def __init__(self, path: str, tokenizer: Tokenizer, max_length: int, chat: bool,
                 system_prompt: Optional[str] = None):
        def encode(row, where: str) -> Encoded:
            encoded = cut_to(encode_demonstration(row, tokenizer, chat, system_prompt, max_length, where), max_length,
                             where)
            if not encoded.response_tokens:
                raise ValueError(f"{where}: no response token within max_length={max_length}; raise it or drop the row")
            return encoded

        self.path = path
        self.file, self.rows = read_encoded(path, encode)
        self.cut = sum(e.cut for e in self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, index: int) -> str:
        return self.file.where(index)
