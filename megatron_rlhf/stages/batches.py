"""Micro-batches of the stages before RL, from encoded sequences (data/exchanges.py). The
conventions are models/batches.py's: ``tokens`` [b, S] right-padded, per-action columns [b, S-1]
(``action_mask``: 1 where the next token is a trained response token).

A preference micro-batch holds whole pairs, so a pair's two sides are always scored by the same
weights in the same step on the same DP rank: ``tokens`` [2k, w] are its k chosen sides then their k
rejected sides in pair order, ``last_index`` [2k] each side's last token, ``margin`` [k], and any
per-side column given ([P, 2] -> [2k]). Pairs are grouped longest first, k pairs a micro-batch
(``micro_batch_size``) or as many as keep 2k x the longest side within the token budget
(``micro_batch_size: auto``); under PP every micro-batch has the same k.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megatron_rlhf.data.exchanges import Encoded
from megatron_rlhf.data.preferences import Pair
from megatron_rlhf.data.steps import NO_LABEL, Steps
from megatron_rlhf.models.batches import ROW_LENGTHS, MicroBatch, micro_batches_of, packed_sizes


def padded(sequences: List[Encoded], pad_id: int, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens`` [B, S], ``action_mask`` [B, S-1] and ``lengths`` [B] of ``sequences``."""
    width = max(max(len(s.ids) for s in sequences), 2)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width - 1), dtype=torch.float32)
    for row, s in enumerate(sequences):
        tokens[row, : len(s.ids)] = torch.tensor(s.ids)
        mask[row, : len(s.ids) - 1] = torch.tensor(s.trained[1:], dtype=torch.float32)
    lengths = torch.tensor([len(s.ids) for s in sequences])
    return tokens.to(device), mask.to(device), lengths.to(device)


def row_micro_batches(role_config, sequences: List[Encoded], pipelined: bool, pad_id: int, device) -> List[MicroBatch]:
    """SFT's micro-batches: the rows grouped by length (or packed by tokens), as every pass cuts them."""
    tokens, mask, lengths = padded(sequences, pad_id, device)
    return micro_batches_of(role_config, lengths, pipelined, tokens=tokens, action_mask=mask)[0]


def step_micro_batches(role_config, rows: List[Steps], pipelined: bool, pad_id: int, device,
                       last_step_only: bool = False) -> List[MicroBatch]:
    """A process reward model's micro-batches: ``tokens`` [b, w] and ``step_labels`` [b, w] (1 or 0 at
    each step's end, NO_LABEL elsewhere; ``last_step_only``: each solution's last step's label alone,
    none where the length limit cut that step off), the rows
    grouped by length (or packed by tokens), as every pass cuts them."""
    width = max(max(len(r.ids) for r in rows), 2)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), NO_LABEL, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r.ids)] = torch.tensor(r.ids)
        marks = torch.tensor(r.labels)
        if last_step_only:  # the solution's last step's label, if its end is within the row
            ends = (marks != NO_LABEL).nonzero().flatten()
            marks[ends if not r.last_step_kept else ends[:-1]] = NO_LABEL
        labels[i, : len(r.ids)] = marks
    lengths = torch.tensor([len(r.ids) for r in rows])
    return micro_batches_of(role_config, lengths.to(device), pipelined, tokens=tokens.to(device),
                            step_labels=labels.to(device))[0]


def pair_micro_batches(role_config, pairs: List[Pair], pipelined: bool, pad_id: int, device,
                       per_side: Optional[Dict[str, torch.Tensor]] = None) -> List[MicroBatch]:
    """Micro-batches of whole pairs (see the module's docstring); ``per_side``: name -> [P, 2]."""
    longest = torch.tensor([max(len(p.chosen.ids), len(p.rejected.ids)) for p in pairs])
    order = torch.sort(longest, descending=True, stable=True).indices.tolist()
    if role_config.token_budget is not None and role_config.pack_rows:  # a pair's real tokens, both sides
        sizes = packed_sizes([len(pairs[i].chosen.ids) + len(pairs[i].rejected.ids) for i in order],
                             role_config.token_budget, real_tokens=True)
    elif role_config.token_budget is not None:
        sizes = packed_sizes([int(longest[i]) for i in order], role_config.token_budget // 2, equal_rows=pipelined)
    else:
        size, rest = role_config.micro_batch_size, len(pairs) % role_config.micro_batch_size
        if rest and pipelined:
            raise ValueError(f"{len(pairs)} pairs do not split into micro-batches of {size} (pipelined: equal ones)")
        sizes = [size] * (len(pairs) // size) + ([rest] if rest else [])
    batches, first = [], 0
    for size in sizes:
        picked = order[first : first + size]
        first += size
        sides = [pairs[i].chosen for i in picked] + [pairs[i].rejected for i in picked]
        tokens, mask, lengths = padded(sides, pad_id, device)
        mb = {"tokens": tokens, "action_mask": mask, "last_index": lengths - 1, ROW_LENGTHS: lengths,
              "margin": torch.tensor([pairs[i].margin for i in picked], dtype=torch.float32, device=device)}
        for name, column in (per_side or {}).items():
            mb[name] = torch.cat([column[picked, 0], column[picked, 1]]).to(device)
        batches.append(mb)
    return batches


def chosen_and_rejected(per_side: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's per-side figures [2k] as (chosen [k], rejected [k])."""
    k = per_side.shape[0] // 2
    return per_side[:k], per_side[k:]
