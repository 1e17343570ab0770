"""Prompt data: a JSONL file of ``{"prompt": "..."}`` lines, tokenized once, served in batches.

Every rank reads the same file and draws the same global order (seeded per pass); each
data-parallel rank takes its contiguous slice of every global batch.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

import torch

from megatron_rlhf.data.tokenizer import Tokenizer


def read_prompts(path: str) -> List[str]:
    """The prompts of a JSONL file, with errors that name the file and line."""
    return [text for _, text in read_prompt_lines(path)]


def read_prompt_lines(path: str) -> List[Tuple[int, str]]:
    """(line number, prompt) of every prompt of a JSONL file; an empty prompt is an error."""
    prompts = []
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: prompt file not found (data.prompt_file)") from None
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f'{path}:{number}: expected an object with a string "prompt", got {line.strip()[:80]}')
            if not record["prompt"].strip():
                raise ValueError(f"{path}:{number}: empty prompt; every line needs text to respond to")
            prompts.append((number, record["prompt"]))
    if not prompts:
        raise ValueError(f"{path}: no prompts in the file")
    return prompts


class PromptDataset:
    """Tokenized prompts (bos first when the tokenizer has one; longer than ``max_length`` keeps
    the last tokens) and a position in an endless, per-pass shuffled order. A batch never spans
    two passes (the tail of a pass that cannot fill one is skipped), unless the whole file is
    smaller than a batch."""

    def __init__(self, prompts: List[str], tokenizer: Tokenizer, max_length: int, seed: int, shuffle: bool = True,
                 source: str = "prompts", lines: Optional[List[int]] = None):
        self.texts = prompts
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        lines = lines or list(range(1, len(prompts) + 1))
        self.token_ids = []
        self.truncated = 0  # prompts longer than max_length (they keep their last tokens)
        for line, text in zip(lines, prompts):
            try:
                ids = bos + tokenizer.encode(text)
            except ValueError as e:
                raise ValueError(f"{source}:{line}: {e}") from None
            if not ids:
                raise ValueError(f"{source}:{line}: the prompt {text!r} encodes to no tokens")
            self.truncated += len(ids) > max_length
            self.token_ids.append(ids[-max_length:])
        self.consumed = 0  # prompts served so far, over all ranks

    def __len__(self) -> int:
        return len(self.texts)

    def _order(self, epoch: int) -> List[int]:
        if not self.shuffle:
            return list(range(len(self)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self), generator=gen).tolist()

    def next_batch(self, global_size: int, dp_rank: int, dp_size: int) -> Dict[str, object]:
        """This DP rank's share of the next ``global_size`` prompts: ``tokens`` [b, P] right-padded
        with the pad id, ``lengths`` [b], ``texts``, ``indices`` (into the file)."""
        epoch, offset = divmod(self.consumed, len(self))
        if offset + global_size > len(self) >= global_size:
            # The rest of this pass cannot fill a batch: drop it, so no batch repeats a prompt.
            self.consumed += len(self) - offset
        indices = []
        while len(indices) < global_size:
            epoch, offset = divmod(self.consumed, len(self))
            take = min(global_size - len(indices), len(self) - offset)
            indices.extend(self._order(epoch)[offset : offset + take])
            self.consumed += take
        per_rank = global_size // dp_size
        mine = indices[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        ids = [self.token_ids[i] for i in mine]
        lengths = torch.tensor([len(x) for x in ids])
        tokens = torch.full((len(ids), int(lengths.max())), self.tokenizer.pad_id, dtype=torch.long)
        for row, x in enumerate(ids):
            tokens[row, : len(x)] = torch.tensor(x)
        return {"tokens": tokens, "lengths": lengths, "texts": [self.texts[i] for i in mine], "indices": mine}

    def state_dict(self) -> Dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.consumed = int(state["consumed"])
