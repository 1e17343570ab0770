"""Prompt data served in batches: the rows of a JSONL or Parquet file (data/rows.py), tokenized when
first served (a plain prompt, or a chat through the tokenizer's template), with the row's other
columns carried along for the reward.

Every rank reads the same file and draws the same global order (seeded per pass); each
data-parallel rank takes its contiguous slice of every global batch. A prompt longer than
``max_length`` tokens is skipped and counted (``overlong: filter``: the next one in the order takes
its place, on every rank alike) or is cut (``truncate``): a string keeps its last tokens, a chat
keeps its template's structure and loses the start of its last user message.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

import torch

from megatron_rlhf.data.rows import Prompt, RowFile, named_tools, open_rows, row_tools, with_system_prompt
from megatron_rlhf.data.tokenizer import Tokenizer


def prompt_text(prompt: Prompt) -> str:
    """What the reward function sees as the prompt: the string, or a chat's last user message
    (the question, also when the chat ends with an assistant message to continue)."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m["role"] == "user" and isinstance(m.get("content"), str)]
    return (users[-1] if users else prompt[-1]).get("content") or ""


def _shown_tools(run_tools: Optional[List[dict]], column: Optional[List[Any]]) -> List[dict]:
    """The specs a row's prompt shows: the run's and the column's specs, or the run's named by the column."""
    run_tools, allowed = list(run_tools or []), named_tools(column)
    if allowed is None:
        return run_tools + list(column or [])
    names = [t["function"]["name"] for t in run_tools]
    unknown = [name for name in allowed if name not in names]
    if unknown:
        raise ValueError(f"its 'tools' column names {', '.join(map(repr, unknown))}, which the run's tools do not "
                         f"have (rollout.tools and rollout.mcp_servers give: {', '.join(names) or 'none'})")
    return [t for t in run_tools if t["function"]["name"] in allowed]


class PromptDataset:
    """A position in an endless, per-pass shuffled order over the rows of a file. A batch never
    spans two passes (the tail of a pass that cannot fill one is skipped), unless the whole file
    is smaller than a batch."""

    def __init__(self, rows: RowFile, tokenizer: Tokenizer, max_length: int, seed: int, shuffle: bool = True,
                 chat: bool = False, system_prompt: Optional[str] = None,
                 overlong: Literal["filter", "truncate"] = "filter", tools: Optional[List[dict]] = None):
        self.rows, self.tokenizer, self.tools = rows, tokenizer, tools
        self.max_length, self.seed, self.shuffle = max_length, seed, shuffle
        self.chat, self.system_prompt, self.overlong = chat, system_prompt, overlong
        self._lengths: Dict[int, int] = {}  # token count of every prompt seen
        self.consumed = 0  # rows drawn so far, over all ranks (skipped ones included)
        self.filtered = 0  # rows skipped for their length, since the start of this process
        self.truncated = 0

    @classmethod
    def from_file(cls, path: str, tokenizer: Tokenizer, data, seed: int, shuffle: Optional[bool] = None,
                  tools: Optional[List[dict]] = None) -> "PromptDataset":
        """The dataset of ``path`` with the settings of ``data`` (a DataConfig); ``tools``: the
        function specs the chat template shows in every prompt."""
        return cls(open_rows(path, data.prompt_key), tokenizer, data.max_prompt_length, seed,
                   data.shuffle if shuffle is None else shuffle, data.apply_chat_template, data.system_prompt,
                   data.overlong_prompts, tools)

    def __len__(self) -> int:
        return len(self.rows)

    def _encode(self, index: int, prompt, fields: Dict[str, Any]) -> List[int]:
        """Row ``index``'s ``prompt`` as ids the model reads (before any cut to max_length); its
        length is kept. With a chat template, the tools shown are the run's and the row's own
        specs, or the run's the row names (a ``tools`` column, row_tools)."""
        if self.chat:
            prompt = with_system_prompt(prompt, self.system_prompt)
        try:
            tools = _shown_tools(self.tools, row_tools(fields.get("tools"))) if self.chat else []
            ids = self.tokenizer.encode_prompt(prompt, self.chat, tools or None)
        except ValueError as e:
            raise ValueError(f"{self.rows.where(index)}: {e}") from None
        if not ids:
            raise ValueError(f"{self.rows.where(index)}: the prompt encodes to no tokens")
        self._lengths[index] = len(ids)
        return ids

    def length(self, index: int) -> int:
        """Row ``index``'s prompt length in tokens."""
        if index not in self._lengths:
            self._encode(index, *self.rows.prompt_and_fields(index))
        return self._lengths[index]

    def check_encodes(self) -> int:
        """Tokenize every prompt (errors name file and line; lengths are kept, ids are not); the
        number longer than max_length (under ``truncate``, each overlong chat is cut once here, so
        one that cannot be is refused now)."""
        overlong = [i for i in range(len(self)) if self.length(i) > self.max_length]
        if self.overlong == "truncate" and self.chat:
            for i in overlong:
                self._fitted(i, *self.rows.prompt_and_fields(i))
        return len(overlong)

    def _order(self, epoch: int) -> List[int]:
        if not self.shuffle:
            return list(range(len(self)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self), generator=gen).tolist()

    def _draw(self, count: int) -> List[int]:
        """The next ``count`` rows of the order (overlong ones skipped under ``filter``)."""
        drawn: List[int] = []
        skipped_in_a_row = 0
        while len(drawn) < count:
            epoch, offset = divmod(self.consumed, len(self))
            index = self._order(epoch)[offset]
            self.consumed += 1
            if self.overlong == "filter" and self.length(index) > self.max_length:
                self.filtered += 1
                skipped_in_a_row += 1
                if skipped_in_a_row >= len(self):
                    raise ValueError(f"{self.rows.path}: every prompt is longer than data.max_prompt_length="
                                     f"{self.max_length} tokens; raise it or set data.overlong_prompts: truncate")
                continue
            skipped_in_a_row = 0
            drawn.append(index)
        return drawn

    def next_batch(self, global_size: int, dp_rank: int, dp_size: int) -> Dict[str, Any]:
        """This DP rank's share of the next ``global_size`` prompts, as :meth:`batch_of`."""
        epoch, offset = divmod(self.consumed, len(self))
        if offset + global_size > len(self) >= global_size:
            # The rest of this pass cannot fill a batch: drop it, so no batch repeats a prompt.
            self.consumed += len(self) - offset
        indices = self._draw(global_size)
        per_rank = global_size // dp_size
        return self.batch_of(indices[dp_rank * per_rank : (dp_rank + 1) * per_rank])

    def usable_indices(self) -> List[int]:
        """Every row in file order, without those ``filter`` skips (validation's prompts)."""
        return [i for i in range(len(self)) if self.overlong == "truncate" or self.length(i) <= self.max_length]

    def batch_of(self, indices: List[int]) -> Dict[str, Any]:
        """Rows ``indices``: ``tokens`` [b, P] right-padded with the pad id (a longer prompt keeps
        its last max_length tokens), ``lengths`` [b], ``texts`` (the prompts as the reward sees
        them), ``fields`` (each row's other columns) and ``indices``."""
        ids, texts, fields = [], [], []
        for i in indices:  # each row read once
            prompt, row_fields = self.rows.prompt_and_fields(i)
            ids.append(self._fitted(i, prompt, row_fields))
            texts.append(prompt_text(prompt))
            fields.append(row_fields)
        self.truncated += sum(self.length(i) > self.max_length for i in indices)
        lengths = torch.tensor([len(x) for x in ids])
        tokens = torch.full((len(ids), int(lengths.max())), self.tokenizer.pad_id, dtype=torch.long)
        for row, x in enumerate(ids):
            tokens[row, : len(x)] = torch.tensor(x)
        return {"tokens": tokens, "lengths": lengths, "texts": texts, "fields": fields, "indices": list(indices)}

    def _fitted(self, index: int, prompt, fields: Dict[str, Any]) -> List[int]:
        """Row ``index``'s ids within max_length: a string prompt keeps its last tokens; a chat
        keeps its template's structure and loses the start of its last user message instead
        (the fewest characters that make it fit)."""
        ids = self._encode(index, prompt, fields)
        if len(ids) <= self.max_length:
            return ids
        if not self.chat:
            return ids[-self.max_length:]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last is None:
            raise ValueError(f"{self.rows.where(index)}: the chat is longer than data.max_prompt_length={self.max_length} "
                             "tokens and has no user message to shorten")
        content = messages[last]["content"]

        def encoded(keep: int) -> List[int]:
            messages[last]["content"] = content[len(content) - keep:] if keep else ""
            return self._encode(index, messages, fields)

        if len(encoded(0)) > self.max_length:
            raise ValueError(f"{self.rows.where(index)}: the chat does not fit in data.max_prompt_length={self.max_length} "
                             "tokens even with its last user message emptied; raise max_prompt_length")
        low, high = 0, len(content)  # the most characters kept that fit
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if len(encoded(middle)) <= self.max_length else (low, middle - 1)
        fitted = encoded(low)
        self._lengths[index] = len(ids)  # the row's own length (counted as truncated), not the cut one's
        return fitted

    def prompt_of(self, index: int) -> str:
        """Row ``index``'s prompt as the reward sees it."""
        return prompt_text(self.rows.prompt_and_fields(index)[0])

    def state_dict(self) -> Dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.consumed = int(state["consumed"])
