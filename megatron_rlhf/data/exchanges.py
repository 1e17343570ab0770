"""A prompt and a response as the ids a model reads, with the mask of the response tokens it is
trained on: the shared encoding of the stages before RL (SFT's demonstrations, RM's and DPO's
preference pairs; data/demonstrations.py, data/preferences.py).

A string prompt and response: the prompt as the tokenizer encodes a prompt (its BOS), the response's
text then the first end token (the model learns to stop), every response token trained. A chat
(``apply_chat_template``): the prompt's messages with the template's generation prompt, then the
response's messages as the template renders the whole chat; trained are the tokens the response's
assistant messages wrote (tokenizer.encode_chat), not a tool's reply between them, nor an earlier
assistant turn the prompt holds (a multi-turn prompt is read, as TRL reads it).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_rlhf.data.rows import Prompt, RowFile, as_messages, check_prompt, open_rows, with_system_prompt
from megatron_rlhf.data.tokenizer import Messages, Tokenizer


@dataclasses.dataclass
class Encoded:
    """One sequence: ``ids`` (prompt then response), ``trained`` (1 per id an assistant wrote, 0 on
    the prompt), ``prompt_length``, and whether its response was cut to the length limit."""

    ids: List[int]
    trained: List[int]
    prompt_length: int
    cut: bool = False

    @property
    def response_tokens(self) -> int:
        return sum(self.trained)


def check_response(value: Any, key: str, where: str) -> None:
    """A response: a non-empty string, or chat messages whose first is the assistant's."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: empty {key!r} response; every pair needs two answers to compare")
        return
    check_prompt(value, key, where)
    if value[0]["role"] != "assistant":
        raise ValueError(f"{where}: {key!r} starts with a {value[0]['role']!r} message after the prompt; a response "
                         "starts with the assistant's (a conversation that repeats the prompt must repeat it whole)")
    if not has_assistant_text(value):
        raise ValueError(f"{where}: empty {key!r} response; every pair needs two answers to compare")


def has_assistant_text(messages: Messages) -> bool:
    """Whether an assistant message of the chat has text (something to learn from)."""
    return any(m["role"] == "assistant" and (m.get("content") or "").strip() for m in messages)


def shown(value: Any) -> str:
    return json.dumps(value, default=str)[:80]


def encode_exchange(tokenizer: Tokenizer, prompt: Prompt, response: Any, chat: bool, max_length: int,
                    system_prompt: Optional[str] = None) -> Encoded:
    """``prompt`` then ``response`` (strings, or chat messages with ``chat``), the response's tokens
    marked; of a response far longer than ``max_length`` tokens only what can fall within it is
    encoded (:func:`within_length`; :func:`cut_to` then cuts the ids)."""
    response = within_length(tokenizer, response, max_length)
    if not chat:
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise ValueError("chat messages need data.apply_chat_template: true (and a tokenizer with a chat template)")
        prompt_ids = tokenizer.encode_prompt(prompt, chat=False)
        response_ids = tokenizer.encode_text(response) + [tokenizer.eos_ids[0]]
        return Encoded(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids), len(prompt_ids))
    messages = as_messages(with_system_prompt(prompt, system_prompt), "user")
    prompt_ids = tokenizer.encode_prompt(messages, chat=True)
    ids, trained = tokenizer.encode_chat(messages + as_messages(response, "assistant"))
    if ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError("the chat template renders the prompt with its generation prompt otherwise than as the start "
                         "of the whole chat; the response tokens cannot be told from the prompt's")
    # An assistant turn inside a multi-turn prompt is read, not trained (TRL trains the completion only).
    return Encoded(ids, [0] * len(prompt_ids) + trained[len(prompt_ids):], len(prompt_ids))


def within_length(tokenizer: Tokenizer, value: Any, max_length: int) -> Any:
    """``value`` (a text, or messages) with the text past what can fall within ``max_length`` tokens
    cut before it is encoded: a text of n x max_token_chars characters holds at least n tokens, so
    characters past twice that budget (room for the tokens at the cut to form as in the whole) are
    beyond the length limit wherever the text sits. A 32 MB response is not encoded whole to keep
    its first tokens."""
    budget = 2 * max_length * tokenizer.max_token_chars + 16
    if isinstance(value, str):
        return value[:budget]
    kept = []
    for message in value:  # messages: the budget counts over their contents in order
        content = message.get("content")
        if isinstance(content, str):
            message, budget = {**message, "content": content[:budget]}, max(0, budget - len(content))
        kept.append(message)
    return kept


def cut_to(encoded: Encoded, max_length: int, where: str) -> Encoded:
    """``encoded`` within ``max_length`` tokens: its response keeps its first tokens; a prompt that
    leaves no room for one response token is refused (a prompt is never cut)."""
    if encoded.prompt_length >= max_length:
        raise ValueError(f"{where}: the prompt alone is {encoded.prompt_length} tokens, and max_length={max_length} "
                         "leaves no room for a response; raise max_length or drop the row")
    if len(encoded.ids) <= max_length:
        return encoded
    return Encoded(encoded.ids[:max_length], encoded.trained[:max_length], encoded.prompt_length, cut=True)


def read_encoded(path: str, encode: Callable[[Dict[str, Any], str], Any]) -> Tuple[RowFile, list]:
    """Every row of ``path`` (JSONL or Parquet, rows of any shape) through ``encode(row, where)``;
    an error names the row's file and line (or row) once."""
    file = open_rows(path, None, prompts=False)
    encoded = []
    for index in range(len(file)):
        where = file.where(index)
        try:
            encoded.append(encode(file.row(index), where))
        except ValueError as e:  # ours name the row already; the tokenizer's and template's do not
            message = str(e)
            raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None
    return file, encoded
