"""Run checkpoints, every stage's: everything needed to continue a run as if it had never stopped.

    OUTPUT/checkpoints/
      latest                          the name of the newest complete checkpoint (written last)
      iter_0000010/
        trainer_state.pt              the run loop's state (run_loop.checkpoint_state: the stage,
                                      the steps done, the stage's own state, the random state, the
                                      run's id and config fingerprint) and the layout it was
                                      written at; tensors and plain types only, loaded weights_only
        manifest.json                 the format and its version, every file's size and CRC-32,
                                      written last
        <trained role>/               each trained role (RL: ppo_policy, ppo_value; sft and dpo:
                                      policy; rm: reward): a model checkpoint (model_files.py
                                      layout: loadable at any TP/PP, convertible to Hugging Face)
                                      plus optim/:
          optim/mp_rank_TT_PPP.pt              the optimizer's common state (DP rank 0)
          optim/state_tTT_pPPP_eEEE_dDDDDD.pt  each rank's own part of the distributed optimizer's
                                               state, written by every rank at once, nothing gathered
                                               (optimizer_state.py: resumes at any TP, PP, EP and DP)

A checkpoint is written into a hidden temporary directory by every rank, renamed into place by
rank 0 once all ranks are done, and only then named in ``latest``: a save that dies midway leaves
the previous checkpoint complete and ``latest`` pointing to it. Nothing read back runs code: every
file loads with torch's ``weights_only``, and a checkpoint of an unknown or newer format is
refused by name (model_files.read_manifest).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.optimizer_state import common_state_for, load_owned_state, owned_state_file, same_layout
from megatron_rlhf.checkpoint.model_files import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    _checksum,
    load_model_shard,
    load_plain,
    manifest_of,
    read_manifest,
    shard_file,
    verify_checkpoint,
    write_model_meta,
)
from megatron_rlhf.config.schema import ROLE_HEADS
from megatron_rlhf.errors import NonFiniteError, RunError
from megatron_rlhf.models.decoder import load_local_state_dict, local_state_dict, unwrap
from megatron_rlhf.models.sharding import experts_renumbered
from megatron_rlhf.runtime import megatron_compat as compat
from megatron_rlhf.runtime.host_groups import host_group

LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def latest_checkpoint(output_dir: str) -> Optional[str]:
    """The newest complete checkpoint of a run, or None when it has none."""
    pointer = os.path.join(checkpoints_dir(output_dir), LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(checkpoints_dir(output_dir), name)
    if not os.path.isfile(os.path.join(path, TRAINER_STATE)):
        raise CheckpointError(f"{pointer} names {name}, which is not a complete checkpoint")
    return path


def _layout():
    """This rank's place. ``dp``: the ranks that hold the same weights and shard their optimizer's
    state (megatron's data-parallel group with the context-parallel ranks: CP ranks hold the same
    weights as DP ranks do), so a checkpoint resumes at another CP as at another DP."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(), "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_world_size(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_world_size(with_context_parallel=True),
        "dp_rank": ps.get_data_parallel_rank(with_context_parallel=True),
        "ep": ps.get_expert_model_parallel_world_size(), "ep_rank": ps.get_expert_model_parallel_rank(),
        "edp_rank": ps.get_expert_data_parallel_rank(),
    }


def _common_file(role_dir: str, layout: dict) -> str:
    """A rank's file of the optimizer's common state (hyperparameters, step): per (TP, PP) rank, and
    per EP rank when experts are split."""
    name = f"mp_rank_{layout['tp_rank']:02d}_{layout['pp_rank']:03d}" + (f"_{layout['ep_rank']:03d}" if layout["ep"] > 1 else "")
    return os.path.join(role_dir, "optim", name + ".pt")


def _writes_optimizer(layout: dict) -> bool:
    """DP rank 0 writes a replica's optimizer state; with experts split, each EP rank's first
    expert-data-parallel rank writes its own."""
    return layout["edp_rank"] == 0 if layout["ep"] > 1 else layout["dp_rank"] == 0


def _full_weights(model, layout: dict, num_experts) -> Optional[dict]:
    """This (TP, PP) rank's weights with every expert of its stage under its global number, on DP
    rank 0 (None elsewhere); collective over the expert-parallel group when experts are split."""
    from megatron.core import parallel_state as ps

    split = bool(num_experts) and layout["ep"] > 1
    if layout["dp_rank"] != 0 and not split:
        return None
    weights = {k: v.detach().cpu().clone() for k, v in local_state_dict(model).items()}
    if split:
        weights = experts_renumbered(weights, num_experts, layout["ep"], layout["ep_rank"])
        everyone = [None] * layout["ep"]
        dist.all_gather_object(everyone, {k: v for k, v in weights.items() if ".local_experts." in k},
                               group=host_group(ps.get_expert_model_parallel_group()))
        for experts in everyone:
            weights.update(experts)
    return weights if layout["dp_rank"] == 0 else None


Writes = List[Tuple[str, Any]]  # (file, what torch.save writes there), host copies only


def save_checkpoint(roles: Mapping[str, Any], trainer_state: Dict[str, Any], output_dir: str,
                        records: Optional[Dict[str, dict]] = None) -> str:
    """Save the trainable roles and ``trainer_state`` (run_loop.checkpoint_state, with its
    ``iteration``) after that step (collective: every rank calls it); ``records``: role -> what
    its model files record beside the weights (write_model_meta). A write that fails (a
    full disk) removes the partial checkpoint and raises RunError naming it; the previous
    checkpoint and ``latest`` stay as they were."""
    pending = PendingSave(trainer_state, output_dir)
    with pending.failing_cleanly():
        for writes in pending.snapshot(roles, records or {}):  # one role's copies in host memory at a time
            write_files(writes)
    pending.finish(None)
    return pending.final


def os_error_text(e: OSError) -> str:
    """What an OSError of a write says, with the file it names."""
    return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")


def write_files(writes: Writes) -> None:
    for path, obj in writes:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(obj, path)


def save_file(obj, path: str) -> None:
    """torch.save, a file it cannot open or write an OSError naming it (torch raises RuntimeError
    for a read-only folder: it must end as a failed save, not a traceback)."""
    try:
        torch.save(obj, path)
    except RuntimeError as e:
        raise OSError(None, str(e).strip().splitlines()[0], path) from None


class PendingSave:
    """One checkpoint on its way: :meth:`snapshot` (collective) takes host copies of everything
    this rank writes, into a temporary directory; the files are written (here or in the
    background, checkpoint/background.py); :meth:`finish` (collective) adds the trainer state and
    the manifest, renames the directory and moves ``latest`` to it: a checkpoint is never seen
    before every rank has written its part."""

    def __init__(self, trainer_state: Dict[str, Any], output_dir: str):
        self.trainer_state, self.output_dir = trainer_state, output_dir
        self.name = f"iter_{trainer_state['iteration']:07d}"
        self.root = checkpoints_dir(output_dir)
        # Temporary names unique to this run (rank 0's pid), so no other writer can share one.
        writer = [os.getpid()]
        dist.broadcast_object_list(writer, src=0, group=host_group())
        self.writer = writer[0]
        self.final, self.tmp = os.path.join(self.root, self.name), os.path.join(self.root, f".{self.name}.tmp-{self.writer}")
        self.layout = _layout()
        self.rank0 = dist.get_rank() == 0

    @contextlib.contextmanager
    def failing_cleanly(self):
        """An OSError while writing: the partial checkpoint removed, RunError naming it."""
        try:
            yield
        except OSError as e:
            raise self.failed(os_error_text(e)) from None

    def failed(self, why: str) -> RunError:
        shutil.rmtree(self.tmp, ignore_errors=True)
        previous = latest_checkpoint(self.output_dir)
        return RunError(f"iteration {self.trainer_state['iteration']}: writing the checkpoint {self.final} failed: "
                        f"{why}; the partial checkpoint was removed; the last complete one, {previous or 'none'}, "
                        f"is kept")

    def snapshot(self, roles: Mapping[str, Any], records: Dict[str, dict]) -> Iterator[Writes]:
        """This rank's files of the checkpoint as host copies, one trained role's at a time (each
        resident while copied; the model metadata, small, written at once by rank 0); collective,
        so every rank takes every role's."""
        layout = self.layout
        if self.rank0:
            shutil.rmtree(self.tmp, ignore_errors=True)
            os.makedirs(self.tmp)
        dist.barrier(group=host_group())
        for role_name in [name for name, role in roles.items() if role.trainable]:
            role = roles[role_name]
            writes: Writes = []
            role_dir = os.path.join(self.tmp, role_name)
            with role.resident("training"):
                _refuse_non_finite(role_name, role.model, self.trainer_state["iteration"])
                weights = _full_weights(role.model, layout, role.config.model.num_experts)
                if weights is not None:
                    writes.append((shard_file(role_dir, layout["tp_rank"], layout["pp_rank"], layout["pp"]),
                                   {"model": weights, "checkpoint_version": 3.0}))
                if _writes_optimizer(layout):
                    writes.append((_common_file(role_dir, layout), _on_host(role.optimizer.state_dict())))
                if role.config.use_distributed_optimizer:  # every rank its own part
                    writes.append(owned_state_file(role.optimizer, role.model, role_dir, layout))
            if self.rank0:
                os.makedirs(role_dir, exist_ok=True)
                param = next(unwrap(role.model).parameters())
                write_model_meta(role_dir, role.config.model, ROLE_HEADS[role_name], param.dtype, layout["tp"],
                                 layout["pp"], lora=role.config.lora.meta(), records=records.get(role_name))
            yield writes

    def finish(self, failure: Optional[str]) -> None:
        """Every rank's files written (``failure``: why one rank's were not, decided together):
        the trainer state, the manifest, the rename and ``latest``."""
        dist.barrier(group=host_group())
        if failure is not None:
            raise self.failed(failure)
        with self.failing_cleanly():
            if self.rank0:
                save_file({**self.trainer_state, "layout": {k: self.layout[k] for k in ("tp", "pp", "dp", "ep")}},
                          os.path.join(self.tmp, TRAINER_STATE))
            _write_manifest(self.tmp, self.rank0)
            if self.rank0:
                shutil.rmtree(self.final, ignore_errors=True)
                os.rename(self.tmp, self.final)
                pointer_tmp = os.path.join(self.root, f".{LATEST}.tmp-{self.writer}")
                with open(pointer_tmp, "w") as f:
                    f.write(self.name)
                os.replace(pointer_tmp, os.path.join(self.root, LATEST))
        dist.barrier(group=host_group())


def _on_host(obj):
    """``obj`` (a state dict) with every tensor copied to the host."""
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_host(v) for v in obj)
    return obj


def _write_manifest(root: str, rank0: bool) -> None:
    """manifest.json: every file of the checkpoint with its size and CRC-32 (the files split over
    the ranks to checksum; collective). Written last, so a checkpoint with a manifest is complete."""
    files = None
    if rank0:
        files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names)
    shared = [files]
    dist.broadcast_object_list(shared, src=0, group=host_group())
    files = shared[0]
    mine = {f: _checksum(os.path.join(root, f)) for f in files[dist.get_rank() :: dist.get_world_size()]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=host_group())
    if rank0:
        sums = {k: v for part in everyone for k, v in part.items()}
        manifest = {f: {"bytes": os.path.getsize(os.path.join(root, f)), "crc32": sums[f]} for f in files}
        with open(os.path.join(root, MANIFEST), "w") as out:
            json.dump(manifest_of(manifest), out, indent=0)


def intact_checkpoints(output_dir: str, checksums: bool = False):
    """The run's checkpoints that verify, newest first."""
    root = checkpoints_dir(output_dir)
    names = sorted((n for n in os.listdir(root) if n.startswith("iter_")), reverse=True) if os.path.isdir(root) else []
    intact = []
    for name in names:
        try:
            verify_checkpoint(os.path.join(root, name), checksums)
            intact.append(os.path.join(root, name))
        except CheckpointError:
            pass
    return intact


def _refuse_non_finite(role_name: str, model, iteration: int) -> None:
    """No checkpoint holds a NaN or infinite weight: every rank checks its shard, all agree."""
    bad = torch.tensor([float(any(not torch.isfinite(p).all() for p in model.parameters()))],
                       device=next(model.parameters()).device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise NonFiniteError(f"iteration {iteration}: {role_name} has non-finite weights; the checkpoint was not "
                             "written (the latest checkpoint is still the last finite state)", collective=True)


def reshardable(role_config) -> Optional[str]:
    """Why a trained role's checkpoint resumes only at the TP, PP and EP it was written at, or None
    (it resumes at any layout: the distributed optimizer's state is cut as its weights)."""
    if not role_config.use_distributed_optimizer:
        return "its optimizer (not the distributed one)"
    return None


def check_layout(path: str, trainer_state: Dict[str, Any], tp: int, pp: int, ep: int = 1, where: str = "",
                 fixed: Optional[str] = None) -> None:
    """Refuse to resume checkpoint ``path`` (its ``trainer_state``) at another TP, PP or EP when a
    trained role's state is tied to its layout (``fixed``: why, from reshardable). ``where`` names
    the setting, for the message."""
    then = {"TP": trainer_state["layout"]["tp"], "PP": trainer_state["layout"]["pp"], "EP": trainer_state["layout"].get("ep", 1)}
    now = {"TP": tp, "PP": pp, "EP": ep}
    if then != now and fixed:
        names = ["TP", "PP"] + (["EP"] if then["EP"] > 1 or ep > 1 else [])  # EP named where experts are split
        sizes = {n: " ".join(f"{k}={v[k]}" for k in names) for n, v in (("then", then), ("now", now))}
        raise CheckpointError(f"{path}: written at {sizes['then']}; resume with the same {', '.join(names[:-1])} and "
                              f"{names[-1]} ({fixed} is per model-parallel rank) (now {sizes['now']}"
                              f"{', ' + where if where else ''}); DP may differ")


def _load_parameter_state(role, role_dir: str, written: dict, layout: dict, head: str) -> None:
    """The distributed optimizer's state from every written rank's part (optimizer_state.py).
    megatron hands every parameter the same step tensor, which torch.optim.Adam increments in place
    once per parameter: give each its own."""
    load_owned_state(role.optimizer, role.model, role_dir, written, layout, role.config.model, head)
    for state in (compat.adam_state(inner) for inner in compat.inner_optimizers(role.optimizer)):
        for values in state.values():
            if "step" in values:
                values["step"] = values["step"].clone()


def _common_state(role, role_dir: str, layout: dict, same: bool):
    """The optimizer's common state (hyperparameters, step): this rank's file at the layout it was
    written at; at another, rebuilt for this optimizer's groups from every written rank's."""
    if same:
        return load_plain(_common_file(role_dir, layout))
    files = sorted(glob.glob(os.path.join(role_dir, "optim", "mp_rank_*.pt")))
    return common_state_for(role.optimizer, [load_plain(f) for f in files])


def read_trainer_state(path: str) -> Dict[str, Any]:
    """Checkpoint ``path``'s trainer state (run_loop.checkpoint_state and the layout), after its
    format: a run checkpoint of another format version than this one's is refused by name."""
    version, _ = read_manifest(path)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: a run checkpoint of format {version}, written by an earlier megatron-rlhf; this "
                              f"version resumes format {FORMAT_VERSION} only. Its trained roles' directories load as "
                              "model checkpoints (<role>.load): start a new run from them")
    return load_plain(os.path.join(path, TRAINER_STATE))


def load_checkpoint(roles: Mapping[str, Any], path: str) -> Dict[str, Any]:
    """Restore the trainable roles from checkpoint ``path`` and return the trainer state saved with
    them (for run_loop.resume; collective). Written at any TP, PP, EP and DP, but
    at its own TP, PP and EP where a role's state is tied to them (reshardable). Everything is read to
    the CPU first, whatever device wrote it."""
    layout = _layout()
    state = read_trainer_state(path)
    written = {"ep": 1, **state["layout"]}
    trained = [name for name, role in roles.items() if role.trainable]
    fixed = next((why for why in (reshardable(roles[name].config) for name in trained) if why), None)
    check_layout(path, state, layout["tp"], layout["pp"], layout["ep"], fixed=fixed)
    same = same_layout(written, layout)
    for role_name in trained:
        role = roles[role_name]
        role_dir = os.path.join(path, role_name)
        # no_grad: fp32 main params can be views of the (grad-requiring) parameters.
        with role.resident("training"), torch.no_grad():
            shard = load_model_shard(role_dir, role.config.model, ROLE_HEADS[role_name], layout["tp"],
                                     layout["tp_rank"], layout["pp"], layout["pp_rank"], layout["ep"], layout["ep_rank"])
            load_local_state_dict(role.model, shard)
            compat.reload_main_params(role.optimizer)
            role.optimizer.load_state_dict(_common_state(role, role_dir, layout, same))
            if role.config.use_distributed_optimizer:
                _load_parameter_state(role, role_dir, written, layout, ROLE_HEADS[role_name])
    return state
