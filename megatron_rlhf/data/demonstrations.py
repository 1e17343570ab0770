"""Demonstrations for supervised fine-tuning (JSONL or Parquet), one per row: a chat in ``messages``
(every assistant message trained, the rest read; needs the chat template), or a ``prompt`` and a
``completion`` (strings, or chat messages with the template; TRL's prompt-completion shape).
Every row is encoded and cut to ``max_length`` when the file is opened (data/exchanges.py): a bad
row stops the run before start-up, named by file and line or row.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from megatron_rlhf.data.exchanges import Encoded, check_response, cut_to, encode_exchange
from megatron_rlhf.data.rows import check_prompt, open_rows
from megatron_rlhf.data.tokenizer import Tokenizer


def encode_demonstration(row: Dict[str, Any], tokenizer: Tokenizer, chat: bool, system_prompt: Optional[str],
                         where: str) -> Encoded:
    if "messages" in row:
        messages = row["messages"]
        check_prompt(messages, "messages", where)
        if not chat:
            raise ValueError(f"{where}: a chat in 'messages' needs data.apply_chat_template: true")
        if not any(m["role"] == "assistant" and (m.get("content") or "").strip() for m in messages):
            raise ValueError(f"{where}: 'messages' has no assistant message with text: nothing to learn from")
        if system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}] + list(messages)
        ids, trained = tokenizer.encode_chat(list(messages))
        return Encoded(ids, trained, trained.index(1))
    missing = [k for k in ("prompt", "completion") if k not in row]
    if missing:
        raise ValueError(f"{where}: no {' or '.join(map(repr, missing))} column; a demonstration is a chat in "
                         f"'messages', or a 'prompt' and its 'completion'; columns: {', '.join(sorted(row))}")
    check_prompt(row["prompt"], "prompt", where)
    check_response(row["completion"], "completion", where)
    return encode_exchange(tokenizer, row["prompt"], row["completion"], chat, system_prompt)


class Demonstrations:
    """Every demonstration of a file, encoded and cut: ``rows[i]`` (Encoded), ``where(i)``;
    ``cut`` counts those whose responses were shortened to ``max_length``."""

    def __init__(self, path: str, tokenizer: Tokenizer, max_length: int, chat: bool,
                 system_prompt: Optional[str] = None):
        self.path = path
        self.file = open_rows(path, None, prompts=False)
        self.rows: List[Encoded] = []
        for index in range(len(self.file)):
            where = self.file.where(index)
            try:
                encoded = encode_demonstration(self.file.row(index), tokenizer, chat, system_prompt, where)
            except ValueError as e:
                message = str(e)
                raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None
            encoded = cut_to(encoded, max_length, where)
            if not encoded.response_tokens:
                raise ValueError(f"{where}: no response token within max_length={max_length}; raise it or drop the row")
            self.rows.append(encoded)
        self.cut = sum(e.cut for e in self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, index: int) -> str:
        return self.file.where(index)
