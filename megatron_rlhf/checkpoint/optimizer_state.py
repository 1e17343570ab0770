"""The distributed optimizer's state in a checkpoint: every rank writes its own part, and a run
resumes at any TP, PP, EP and DP (checkpoint/run_checkpoint.py).

Each rank writes ``optim/state_tTT_pPPP_eEEE_dDDDDD.pt``: for every parameter of which its DP rank
owns a range of the flattened tensor, the range and the fp32 main values and Adam moments over it,
by the parameter's local name (models/sharding.py). Nothing is gathered: a rank writes 12 bytes a
parameter of its 1/DP share, all ranks at once.

On load each rank rebuilds, for every parameter it owns a range of under its own layout, that
parameter's flattened tensors from the pieces the writers' DP ranks hold: at the layout it was
written at, by concatenating them; at another TP, PP or EP, by joining the old TP pieces into the
full tensor (an expert's from the EP rank that held it) and cutting the new one with the weights'
own rules (sharding.merge_tensor / shard_state_dict / experts_of_rank), so the moments follow their
weights exactly. The common state (hyperparameters and step per parameter group) is rebuilt for the
new optimizer's own groups (``common_state_for``). LoRA adapters alike: each factor is cut as the
weights' rules cut it (models/sharding.py).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron_rlhf.checkpoint.model_files import CheckpointError, load_plain
from megatron_rlhf.models.sharding import (
    experts_of_rank,
    merge_tensor,
    shard_state_dict,
    stage_layers,
    to_local_layer_names,
)
from megatron_rlhf.runtime import megatron_compat as compat

KINDS = ("param", "exp_avg", "exp_avg_sq")
_FILE = re.compile(r"state_t(\d+)_p(\d+)_e(\d+)_d(\d+)\.pt$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)(\..+)$")
# megatron's parameter-group identifiers (optimizer.param_group_identifier_keys) but the one that
# says where experts live: is_expert_parallel is true only at EP > 1, where experts have an
# optimizer of their own in the chain; at EP = 1 they share the dense optimizer's groups.
_GROUP_KEYS = ("wd_mult", "lr_mult", "is_decoupled_lr")


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
                params = load_plain(path, mmap=True)["params"]
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
        w, layout, arch = self.written, self.layout, self.arch
        if self.same:
            whole = self._joined(layout["tp_rank"], layout["pp_rank"], layout["ep_rank"], key)
            return {k: v.reshape(-1) for k, v in whole.items()}
        full_key, (stage, ep_rank, source_key) = self._source(key, layout)
        joined = [self._joined(t, stage, ep_rank, source_key) for t in range(w["tp"])]  # each TP rank's, once
        full = {k: merge_tensor(source_key, [j[k] for j in joined], arch.vocab_size, self.head) for k in KINDS}
        padded = arch.padded_vocab_size(layout["tp"])
        cut = {}
        for k in KINDS:
            cut[k] = shard_state_dict({full_key: full[k]}, arch.num_layers, padded, layout["tp"], layout["tp_rank"],
                                      layout["pp"], layout["pp_rank"], head=self.head, tied=arch.tied_output(self.head))
            if arch.num_experts:
                cut[k] = experts_of_rank(cut[k], arch.num_experts, layout["ep"], layout["ep_rank"])
        if any(key not in c for c in cut.values()) or tuple(cut["param"][key].shape) != tuple(shape):
            raise CheckpointError(f"optimizer state of {key}: cannot be cut for TP={layout['tp']} PP={layout['pp']} "
                                  f"EP={layout['ep']}")
        return {k: cut[k][key].reshape(-1) for k in KINDS}

    def _source(self, key: str, layout: dict) -> Tuple[str, Tuple[int, Optional[int], str]]:
        """The full name of the parameter the rank at ``layout`` holds as ``key``, and where the
        written checkpoint holds it: (its PP rank, its EP rank for an expert, its local name there)."""
        w, layers = self.written, self.arch.num_layers
        match = _LAYER.match(key)
        if match:
            layer = int(match.group(1)) + stage_layers(layers, layout["pp"], layout["pp_rank"]).start
            rest, source_rest, ep_rank = match.group(2), match.group(2), None
            expert = _LOCAL_EXPERT.match(rest)
            if expert:  # local expert number -> global -> the written EP rank and its local number there
                per_now, per_then = self.arch.num_experts // layout["ep"], self.arch.num_experts // w["ep"]
                number = int(expert.group(1)) + layout["ep_rank"] * per_now
                ep_rank = number // per_then
                rest = f"mlp.experts.local_experts.{number}{expert.group(2)}"
                source_rest = f"mlp.experts.local_experts.{number % per_then}{expert.group(2)}"
            per_stage = layers // w["pp"]
            return (f"decoder.layers.{layer}.{rest}",
                    (layer // per_stage, ep_rank, f"decoder.layers.{layer % per_stage}.{source_rest}"))
        if key == "output_layer.weight" and self.arch.tied_output(self.head):
            return "embedding.word_embeddings.weight", (0, None, "embedding.word_embeddings.weight")
        first, last = 0, w["pp"] - 1
        return key, (first if key.startswith("embedding.") else last, None, key)


def common_state_for(optimizer, written: List) -> object:
    """The optimizer's common state (hyperparameters and step per parameter group: what
    ``optimizer.state_dict()`` holds) from the common states of a checkpoint written at another
    layout (every written rank's, ``written``), rebuilt for this optimizer's own chain and groups:
    each group takes the written group of the same kind (megatron's identifier keys) whatever
    optimizer of the written chain held it."""
    parts = [part for state in written for part in (state if isinstance(state, list) else [state])]
    by_kind: Dict[tuple, dict] = {}
    for part in parts:
        for group in part["optimizer"]["param_groups"]:
            by_kind.setdefault(tuple(group[k] for k in _GROUP_KEYS), group)
    chain = []
    for inner in compat.inner_optimizers(optimizer):
        groups = []
        for group in compat.param_groups(inner):
            kind = tuple(group[k] for k in _GROUP_KEYS)
            if kind not in by_kind:
                raise CheckpointError(f"optimizer parameter group {dict(zip(_GROUP_KEYS, kind))}: the checkpoint has "
                                      f"none of its kind (it has {sorted(by_kind)})")
            groups.append({**by_kind[kind], "is_expert_parallel": group["is_expert_parallel"]})
        chain.append({**parts[0], "optimizer": {**parts[0]["optimizer"], "param_groups": groups}})
    return chain[0] if len(chain) == 1 else chain
