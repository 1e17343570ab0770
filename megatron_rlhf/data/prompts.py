"""Prompt data served in batches: the rows of a JSONL or Parquet file (data/rows.py), tokenized when
first served (a plain prompt, or a chat through the tokenizer's template), with the row's other
columns carried along for the reward.

Every rank reads the same file and draws the same global order (seeded per pass); each
data-parallel rank takes its contiguous slice of every global batch. A prompt longer than
``max_length`` tokens is skipped and counted (``overlong: filter``: the next one in the order takes
its place, on every rank alike) or keeps its last tokens (``truncate``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

import torch

from megatron_rlhf.data.rows import Prompt, RowFile, open_rows
from megatron_rlhf.data.tokenizer import Tokenizer


def prompt_text(prompt: Prompt) -> str:
    """What the reward function sees as the prompt: the string, or a chat's last message."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


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

    def _encode(self, index: int, prompt) -> List[int]:
        """Row ``index``'s ``prompt`` as ids the model reads (before any cut to max_length); its
        length is kept."""
        if self.chat and self.system_prompt is not None:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if messages[0]["role"] != "system":
                prompt = [{"role": "system", "content": self.system_prompt}] + messages
        try:
            ids = self.tokenizer.encode_prompt(prompt, self.chat, self.tools if self.chat else None)
        except ValueError as e:
            raise ValueError(f"{self.rows.where(index)}: {e}") from None
        if not ids:
            raise ValueError(f"{self.rows.where(index)}: the prompt encodes to no tokens")
        self._lengths[index] = len(ids)
        return ids

    def length(self, index: int) -> int:
        """Row ``index``'s prompt length in tokens."""
        if index not in self._lengths:
            self._encode(index, self.rows.prompt_and_fields(index)[0])
        return self._lengths[index]

    def check_encodes(self) -> int:
        """Tokenize every prompt (errors name file and line; lengths are kept, ids are not); the
        number longer than max_length."""
        return sum(self.length(i) > self.max_length for i in range(len(self)))

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
            ids.append(self._encode(i, prompt)[-self.max_length:])
            texts.append(prompt_text(prompt))
            fields.append(row_fields)
        self.truncated += sum(self.length(i) > self.max_length for i in indices)
        lengths = torch.tensor([len(x) for x in ids])
        tokens = torch.full((len(ids), int(lengths.max())), self.tokenizer.pad_id, dtype=torch.long)
        for row, x in enumerate(ids):
            tokens[row, : len(x)] = torch.tensor(x)
        return {"tokens": tokens, "lengths": lengths, "texts": texts, "fields": fields, "indices": list(indices)}

    def prompt_of(self, index: int) -> str:
        """Row ``index``'s prompt as the reward sees it."""
        return prompt_text(self.rows.prompt_and_fields(index)[0])

    def state_dict(self) -> Dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.consumed = int(state["consumed"])
