"""The distributed optimizer's state in a checkpoint: every rank writes its own part, and a run
resumes at any TP, PP and DP (checkpoint/ppo_state.py).

Each rank writes ``optim/state_tTT_pPPP_eEEE_dDDDDD.pt``: for every parameter of which its DP rank
owns a range of the flattened tensor, the range and the fp32 main values and Adam moments over it,
by the parameter's local name (models/sharding.py). Nothing is gathered: a rank writes 12 bytes a
parameter of its 1/DP share, all ranks at once.

On load each rank rebuilds, for every parameter it owns a range of under its own layout, that
parameter's flattened tensors from the pieces the writers' DP ranks hold: at the layout it was
written at, by concatenating them; at another TP or PP, by joining the old TP pieces into the full
tensor and cutting the new one with the weights' own rules (sharding.merge_tensor /
shard_state_dict), so the moments follow their weights exactly. Experts and LoRA adapters resume at
their own TP, PP and EP (any DP).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron_rlhf.checkpoint.model_files import CheckpointError
from megatron_rlhf.models.sharding import merge_tensor, shard_state_dict, stage_layers, to_local_layer_names
from megatron_rlhf.runtime import megatron_compat as compat

KINDS = ("param", "exp_avg", "exp_avg_sq")
_FILE = re.compile(r"state_t(\d+)_p(\d+)_e(\d+)_d(\d+)\.pt$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def state_file(role_dir: str, layout: dict) -> str:
    return os.path.join(role_dir, "optim", f"state_t{layout['tp_rank']:02d}_p{layout['pp_rank']:03d}_"
                                           f"e{layout['ep_rank']:03d}_d{layout['dp_rank']:05d}.pt")


def named_parameters(model) -> Dict[str, torch.nn.Parameter]:
    """The model's parameters under their local names (those of its checkpoint's weights)."""
    from megatron_rlhf.models.decoder import unwrap

    return to_local_layer_names(dict(unwrap(model).named_parameters()))


def owned_state_file(optimizer, model, role_dir: str, layout: dict) -> Tuple[str, dict]:
    """This rank's part of the distributed optimizer's state (every rank writes its own, at once),
    as host copies, and the file it goes to."""
    owned = compat.owned_optimizer_state(optimizer, named_parameters(model))
    state = {key: {"shape": v["shape"], "start": v["start"], "end": v["end"],
                   **{k: v[k].detach().cpu().clone() for k in KINDS}} for key, v in owned.items()}
    return state_file(role_dir, layout), {"layout": {k: layout[k] for k in ("tp", "pp", "ep", "dp")}, "params": state}


def same_layout(written: dict, layout: dict) -> bool:
    """Whether a checkpoint written at ``written`` is read at the TP, PP and EP it was written at
    (DP may differ)."""
    return (written["tp"], written["pp"], written["ep"]) == (layout["tp"], layout["pp"], layout["ep"])


def load_owned_state(optimizer, model, role_dir: str, written: dict, layout: dict, arch, head: str) -> None:
    """Fill this rank's part of the optimizer's state (its owned ranges under ``layout``) from the
    parts of a checkpoint written at layout ``written`` (tp, pp, ep, dp)."""
    pieces = _Pieces(role_dir, written, layout, arch, head)
    for key, owned in compat.owned_optimizer_state(optimizer, named_parameters(model)).items():
        whole = pieces.local(key, owned["shape"])
        for kind in KINDS:
            owned[kind].copy_(whole[kind][owned["start"] : owned["end"]])


class _Pieces:
    """The pieces a rank at ``layout`` reads of a checkpoint's optimizer files, memory-mapped: at
    the layout it was written at its own slice's only; at another, every slice's."""

    def __init__(self, role_dir: str, written: dict, layout: dict, arch, head: str):
        self.written, self.layout, self.arch, self.head = written, layout, arch, head
        self.same = same_layout(written, layout)
        files = sorted(glob.glob(os.path.join(role_dir, "optim", "state_t*.pt")))
        expected = written["tp"] * written["pp"] * written["dp"]
        if len(files) != expected:
            raise CheckpointError(f"{role_dir}/optim: {len(files)} optimizer state files, the layout it was written at "
                                  f"(TP={written['tp']} PP={written['pp']} DP={written['dp']}) has {expected}")
        # (tp rank, pp rank, ep rank or None for a dense parameter, key) -> its pieces (shape, start, end, tensors)
        self.by_slice: Dict[Tuple, List[dict]] = {}
        for path in files:
            t, p, e, _ = (int(g) for g in _FILE.search(path).groups())
            if self.same and (t, p) != (layout["tp_rank"], layout["pp_rank"]):
                continue
            try:
                params = torch.load(path, map_location="cpu", mmap=True, weights_only=False)["params"]
            except (RuntimeError, EOFError, OSError, KeyError) as err:
                raise CheckpointError(f"{path}: unreadable ({err}); the checkpoint is damaged") from None
            for key, piece in params.items():
                slot = (t, p, e if ".local_experts." in key else None, key)
                self.by_slice.setdefault(slot, []).append(piece)

    def _joined(self, tp_rank: int, pp_rank: int, ep_rank: Optional[int], key: str) -> Dict[str, torch.Tensor]:
        """One written rank's whole local tensors of ``key`` (its DP ranks' pieces end to end)."""
        slot = (tp_rank, pp_rank, ep_rank if ".local_experts." in key else None, key)
        pieces = sorted(self.by_slice.get(slot, []), key=lambda piece: piece["start"])
        shape = pieces[0]["shape"] if pieces else None
        numel = 1 if shape is None else int(torch.Size(shape).numel())
        if not pieces or pieces[0]["start"] != 0 or pieces[-1]["end"] != numel or any(
                a["end"] != b["start"] for a, b in zip(pieces, pieces[1:])):
            raise CheckpointError(f"optimizer state of {key} (TP rank {tp_rank}, PP rank {pp_rank}): its pieces do not "
                                  "cover the parameter; the checkpoint is incomplete")
        return {k: torch.cat([piece[k] for piece in pieces]).view(shape) for k in KINDS}

    def local(self, key: str, shape: tuple) -> Dict[str, torch.Tensor]:
        """``key``'s flattened tensors as the rank at this layout holds the parameter."""
        w, layout = self.written, self.layout
        if self.same:
            whole = self._joined(layout["tp_rank"], layout["pp_rank"], layout["ep_rank"], key)
            return {k: v.reshape(-1) for k, v in whole.items()}
        full_key, (stage, source_key) = self._source(key, layout)
        joined = [self._joined(t, stage, None, source_key) for t in range(w["tp"])]  # each TP rank's, once
        full = {k: merge_tensor(source_key, [j[k] for j in joined], self.arch.vocab_size, self.head) for k in KINDS}
        padded = self.arch.padded_vocab_size(layout["tp"])
        cut = {k: shard_state_dict({full_key: full[k]}, self.arch.num_layers, padded, layout["tp"], layout["tp_rank"],
                                   layout["pp"], layout["pp_rank"], head=self.head,
                                   tied=self.arch.tied_output(self.head)) for k in KINDS}
        if any(key not in c for c in cut.values()) or tuple(cut["param"][key].shape) != tuple(shape):
            raise CheckpointError(f"optimizer state of {key}: cannot be cut for TP={layout['tp']} PP={layout['pp']}")
        return {k: cut[k][key].reshape(-1) for k in KINDS}

    def _source(self, key: str, layout: dict) -> Tuple[str, Tuple[int, str]]:
        """The full name of the parameter the rank at ``layout`` holds as ``key``, and where the
        written checkpoint holds it: (its PP rank, its local name there)."""
        w, layers = self.written, self.arch.num_layers
        match = _LAYER.match(key)
        if match:
            layer = int(match.group(1)) + stage_layers(layers, layout["pp"], layout["pp_rank"]).start
            per_stage = layers // w["pp"]
            return (f"decoder.layers.{layer}.{match.group(2)}",
                    (layer // per_stage, f"decoder.layers.{layer % per_stage}.{match.group(2)}"))
        if key == "output_layer.weight" and self.arch.tied_output(self.head):
            return "embedding.word_embeddings.weight", (0, "embedding.word_embeddings.weight")
        first, last = 0, w["pp"] - 1
        return key, (first if key.startswith("embedding.") else last, key)
