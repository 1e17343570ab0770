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


def save_owned_state(optimizer, model, role_dir: str, layout: dict) -> None:
    """This rank's part of the distributed optimizer's state (every rank, at once)."""
    owned = compat.owned_optimizer_state(optimizer, named_parameters(model))
    state = {key: {"shape": v["shape"], "start": v["start"], "end": v["end"],
                   **{k: v[k].detach().cpu().clone() for k in KINDS}} for key, v in owned.items()}
    path = state_file(role_dir, layout)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"layout": {k: layout[k] for k in ("tp", "pp", "ep", "dp")}, "params": state}, path)


def load_owned_state(optimizer, model, role_dir: str, written: dict, layout: dict, arch, head: str) -> None:
    """Fill this rank's part of the optimizer's state (its owned ranges under ``layout``) from the
    parts of a checkpoint written at layout ``written`` (tp, pp, ep, dp)."""
    same = (written["tp"], written["pp"], written["ep"]) == (layout["tp"], layout["pp"], layout["ep"])
    # At the layout it was written at a rank needs its own slice's pieces only; at another, every slice's.
    pieces = _Pieces(role_dir, written, arch, head, (layout["tp_rank"], layout["pp_rank"]) if same else None)
    for key, owned in compat.owned_optimizer_state(optimizer, named_parameters(model)).items():
        whole = pieces.local(key, owned["shape"], layout)
        for kind in KINDS:
            owned[kind].copy_(whole[kind][owned["start"] : owned["end"]])


class _Pieces:
    """The pieces of every parameter in a checkpoint's optimizer files (``only``: of one (TP, PP)
    rank's), read memory-mapped."""

    def __init__(self, role_dir: str, written: dict, arch, head: str, only: Optional[Tuple[int, int]] = None):
        self.written, self.arch, self.head = written, arch, head
        files = sorted(glob.glob(os.path.join(role_dir, "optim", "state_t*.pt")))
        expected = written["tp"] * written["pp"] * written["dp"]
        if len(files) != expected:
            raise CheckpointError(f"{role_dir}/optim: {len(files)} optimizer state files, the layout it was written at "
                                  f"(TP={written['tp']} PP={written['pp']} DP={written['dp']}) has {expected}")
        # (tp rank, pp rank, ep rank or None for a dense parameter, key) -> [(start, end, tensors)]
        self.by_slice: Dict[Tuple, List[Tuple[int, int, dict]]] = {}
        self.shapes: Dict[Tuple, tuple] = {}
        for path in files:
            t, p, e, _ = (int(g) for g in _FILE.search(path).groups())
            if only is not None and (t, p) != only:
                continue
            try:
                params = torch.load(path, map_location="cpu", mmap=True, weights_only=False)["params"]
            except (RuntimeError, EOFError, OSError, KeyError) as err:
                raise CheckpointError(f"{path}: unreadable ({err}); the checkpoint is damaged") from None
            for key, piece in params.items():
                slot = (t, p, e if ".local_experts." in key else None, key)
                self.by_slice.setdefault(slot, []).append((piece["start"], piece["end"], piece))
                self.shapes[slot] = piece["shape"]

    def _joined(self, tp_rank: int, pp_rank: int, ep_rank: Optional[int], key: str) -> Dict[str, torch.Tensor]:
        """One written rank's whole local tensors of ``key`` (its DP ranks' pieces end to end)."""
        slot = (tp_rank, pp_rank, ep_rank if ".local_experts." in key else None, key)
        pieces = sorted(self.by_slice.get(slot, []), key=lambda piece: piece[0])
        shape = self.shapes.get(slot)
        numel = 1 if shape is None else int(torch.Size(shape).numel())
        if not pieces or pieces[0][0] != 0 or pieces[-1][1] != numel or any(
                a[1] != b[0] for a, b in zip(pieces, pieces[1:])):
            raise CheckpointError(f"optimizer state of {key} (TP rank {tp_rank}, PP rank {pp_rank}): its pieces do not "
                                  "cover the parameter; the checkpoint is incomplete")
        return {k: torch.cat([piece[2][k] for piece in pieces]).view(shape) for k in KINDS}

    def local(self, key: str, shape: tuple, layout: dict) -> Dict[str, torch.Tensor]:
        """``key``'s flattened tensors as the rank at ``layout`` holds the parameter."""
        w = self.written
        if (w["tp"], w["pp"], w["ep"]) == (layout["tp"], layout["pp"], layout["ep"]):
            whole = self._joined(layout["tp_rank"], layout["pp_rank"], layout["ep_rank"], key)
            return {k: v.reshape(-1) for k, v in whole.items()}
        full_key, source = self._source(key, layout)
        full = {k: merge_tensor(source[1], [self._joined(t, source[0], None, source[1])[k] for t in range(w["tp"])],
                                self.arch.vocab_size, self.head) for k in KINDS}
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
