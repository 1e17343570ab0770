"""The run an output directory holds, and the policy around it: one run per directory (a lock),
its identity and config fingerprint (saved with every checkpoint), the checks before a resume
(an intact checkpoint of this layout, of a run with the same settings), clearing it for
--overwrite, and its logs cut back to the checkpoint (a torn last record dropped). Used by
train.prepare before any process group or model exists."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import time
import uuid
import warnings
from typing import Any, Dict, List, Tuple

from megatron_rlhf.config import ConfigError
from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.memory.auto import CHOICE_FILE, SLOTS_FILE

_LOCKS: Dict[str, int] = {}  # output directory -> the descriptor holding its lock (for the process's life)
LOCK_FILE = ".run.lock"


def lock_output_dir(output_dir: str) -> None:
    """One run per output directory: an exclusive lock on ``.run.lock``, held until this process
    ends (the kernel releases it however the process ends, so a dead run's lock is taken over).
    Refused with the holder's host and pid while another run holds it."""
    import fcntl
    import socket

    path = os.path.join(os.path.abspath(output_dir), LOCK_FILE)
    if path in _LOCKS:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"{output_dir} is in use by another run ({holder}); wait for it to end, or choose another "
                          "--output-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    _LOCKS[path] = fd


def remove_partial_saves(output_dir: str) -> List[str]:
    """Remove the temporary directories of checkpoint saves whose writer died (the output
    directory's lock is held: no live writer shares it); the names removed."""
    found = sorted(glob.glob(os.path.join(output_dir, "checkpoints", ".iter_*.tmp-*")))
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return [os.path.basename(p) for p in found]


def release_output_dir(output_dir: str) -> None:
    fd = _LOCKS.pop(os.path.join(os.path.abspath(output_dir), LOCK_FILE), None)
    if fd is not None:
        os.close(fd)


# What only changes how the work is cut or kept (never the numbers), or how long the run goes:
# a resume may change these freely. The layouts of the roles served the trained roles' weights
# (policy, value) are among them: their weights come from the checkpoint's trained roles at any layout;
# so is the run's layout (checkpoint/optimizer_state.py cuts the optimizer state anew; a role whose state
# is tied to its layout is refused by run_checkpoint.check_layout, naming why).
_FREE_ON_RESUME = ("ppo.iterations", ".epochs", ".max_steps", "trainer.", "generation.batch_size", ".micro_batch_size",
                   "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                   "parallel.expert_model_parallel_size", "parallel.sequence_parallel",
                   ".max_tokens_per_micro_batch", "policy.parallel.", "value.parallel.", ".free_memory",
                   ".offload_weights", ".free_grad_buffers", ".offload_optimizer_state", ".empty_cache",
                   ".recompute_activations", ".overlap_grad_reduce", ".cuda_graph_impl", ".nccl_ub", "reward.max_abs_score",
                   "reward.num_workers", "data.val_file")


def run_identity(config: RLHFConfig) -> Dict[str, Any]:
    """A new run's id, the fingerprint of the settings that shape its numbers, and those settings."""
    tree = config.settings()
    values = {k: v for k, v in _flatten(tree).items() if not any(
        k.endswith(f) if f.startswith(".") else k.startswith(f) if f.endswith(".") else k == f for f in _FREE_ON_RESUME)}
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"id": uuid.uuid4().hex[:12], "fingerprint": digest, "config": values}


def _flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_resume(path: str, config: RLHFConfig, now: Dict[str, Any], output_dir: str,
                 allow_config_change: bool) -> Tuple[Dict[str, Any], int]:
    """The run a resume continues (its id, with ``now``'s fingerprint: run_identity of this config)
    and the iteration the checkpoint is at, after checking that the checkpoint is intact, of this
    TP/PP and of a run with the same settings (unless allowed)."""
    from megatron_rlhf.checkpoint.model_files import CheckpointError
    from megatron_rlhf.checkpoint.model_files import verify_checkpoint
    from megatron_rlhf.checkpoint.run_checkpoint import check_layout, intact_checkpoints, read_trainer_state, reshardable

    try:
        verify_checkpoint(path, checksums=int(os.environ.get("LOCAL_RANK", "0")) == 0)
        state = read_trainer_state(path)
    except (CheckpointError, OSError, RuntimeError, EOFError) as e:
        older = [c for c in intact_checkpoints(output_dir) if c != path]
        advice = (f"the newest intact checkpoint is {older[0]}: to resume from it, write "
                  f"'{os.path.basename(older[0])}' into {os.path.join(os.path.dirname(path), 'latest')}"
                  if older else "no older intact checkpoint exists; start again with --overwrite")
        raise CheckpointError(f"cannot resume from {path}: {e}; {advice}") from None
    if state["stage"] != config.stage:
        raise ConfigError(f"{path} is a checkpoint of stage {state['stage']}, and this run is stage {config.stage} "
                          f"({config.at('stage')}): a stage resumes its own checkpoints only; start a {config.stage} run "
                          f"from its trained roles' directories (<role>.load), or resume with the config that wrote it")
    par = config.parallel
    sizes = {"tp": "tensor", "pp": "pipeline", "ep": "expert"}
    changed = [f"parallel.{name}_model_parallel_size" for key, name in sizes.items()
               if state["layout"].get(key, 1) != getattr(par, f"{name}_model_parallel_size")]
    fixed = next((why for why in (reshardable(config.role(r)) for r in config.trainable_roles) if why), None)
    check_layout(path, state, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                 par.expert_model_parallel_size, "; ".join(config.at(key) for key in changed), fixed)
    seeded = _seeded_roles(config)
    if changed and seeded:
        raise ConfigError(f"{path}: resumed at another layout ({'; '.join(config.at(key) for key in changed)}), but "
                          f"{', '.join(seeded)} {'has' if len(seeded) == 1 else 'have'} no load: such weights are drawn "
                          "from the seed per shard, so at another layout they would be another network; give "
                          f"{'it' if len(seeded) == 1 else 'them'} a load: checkpoint, or resume at the layout it was "
                          "written at")
    before = state.get("run")
    if before is None:
        return now, state["iteration"]
    reshaped = _reshaped_networks(before["config"], now["config"], config.trainable_roles)
    if reshaped:
        raise ConfigError(f"{path} holds networks of other shapes ({reshaped}): its tensors cannot be loaded into "
                          "these, --allow-config-change or not; resume with the settings it was written with, or start "
                          "again with --overwrite (its weights converted into a load: checkpoint)")
    if before["fingerprint"] != now["fingerprint"] and not allow_config_change:
        changed = sorted(k for k in set(before["config"]) | set(now["config"])
                         if before["config"].get(k) != now["config"].get(k))
        shown = "; ".join(f"{k}: {before['config'].get(k)!r} then, {now['config'].get(k)!r} now" for k in changed[:8])
        raise ConfigError(f"{path} belongs to a run with other settings ({shown}); resume with the same settings, "
                          "pass --allow-config-change to continue it with these, or start again with --overwrite")
    return {**now, "id": before["id"]}, state["iteration"]


def _seeded_roles(config: RLHFConfig) -> list:
    """The networks a run draws from its seed that no checkpoint restores: frozen roles without a
    load (the trained roles and those they serve come back from the checkpoint)."""
    return [r for r in config.model_roles if r not in config.trainable_roles and r not in config.served_weights
            and not config.role(r).load and not (r == "reward" and config.reward.type != "model")]


# The settings a trained role's checkpoint tensors are shaped by (its network and its adapters).
_SHAPING = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
            "head_dim", "qkv_bias", "qk_norm", "tie_word_embeddings", "num_experts", "moe_ffn_hidden_size",
            "moe_layer_step", "moe_dense_layers", "moe_shared_expert_ffn_hidden_size", "make_vocab_size_divisible_by")


def _reshaped_networks(before: Dict[str, Any], now: Dict[str, Any], roles) -> str:
    """The shaping settings of ``roles`` that differ between a checkpoint's run and this one."""
    keys = [f"{role}.model.{name}" for role in roles for name in _SHAPING]
    keys += [f"{role}.lora.{name}" for role in roles for name in ("rank", "target_modules")]
    return "; ".join(f"{k}: {before.get(k)!r} then, {now.get(k)!r} now" for k in keys
                     if k in before and k in now and before[k] != now[k])


def read_records(path: str) -> list:
    """The JSON records of a JSONL log; a torn line (what a crash or a full disk leaves as the last
    one) is dropped with a warning naming it."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{number}: a torn record ({line.strip()[:40]!r}...) is dropped")
    return records


def completed_iterations(metrics_path: str) -> int:
    """Iterations a run has written to metrics.jsonl (0 for none or no file; a validation before
    training is iteration 0)."""
    if not os.path.exists(metrics_path):
        return 0
    return sum(1 for record in read_records(metrics_path) if record.get("iteration", 0) >= 1)


RUN_RECORD = "run.json"  # the kind of run a directory holds: its top config file and stage
RUN_FILES = ("metrics.jsonl", "memory.jsonl", "checkpoints", "tensorboard", "wandb", CHOICE_FILE, SLOTS_FILE, RUN_RECORD)


def record_run(output_dir: str, config: RLHFConfig) -> None:
    """run.json: the top config file and the stage of the run ``output_dir`` now holds."""
    record = {"config_file": config.origin[""], "stage": config.stage}
    with open(os.path.join(output_dir, RUN_RECORD + ".tmp"), "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(os.path.join(output_dir, RUN_RECORD + ".tmp"), os.path.join(output_dir, RUN_RECORD))


def check_overwrite(output_dir: str, config: RLHFConfig) -> None:
    """--overwrite replaces only a run of the same top config file: a directory that holds another
    kind of run (a demo's default directory exported for a real run), or a run that records none,
    is refused by name, nothing removed."""
    held = [name for name in RUN_FILES if name != RUN_RECORD and os.path.exists(os.path.join(output_dir, name))]
    if not held:
        return
    try:
        with open(os.path.join(output_dir, RUN_RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = None
    if record is not None and record.get("config_file") == config.origin[""]:
        return
    what = (f"a run of {record.get('config_file')} (stage {record.get('stage')})" if isinstance(record, dict)
            else f"a run ({', '.join(held)}) that records no config file")
    raise ConfigError(f"{output_dir} holds {what}; --overwrite replaces only a run of this config file "
                      f"({config.origin['']}), nothing was removed: choose another --output-dir, or remove the "
                      "directory yourself if that run may go")
SET_ASIDE = ".overwritten"  # the run an --overwrite launch replaces, until its first iteration is done


def set_aside_run(output_dir: str) -> None:
    """--overwrite: move the earlier run (metrics, ledger, checkpoints, TensorBoard and W&B logs)
    into ``.overwritten/``, to be dropped once the new run has finished an iteration
    (drop_set_aside) or put back if it fails before (restore_set_aside)."""
    aside = os.path.join(output_dir, SET_ASIDE)
    shutil.rmtree(aside, ignore_errors=True)
    os.makedirs(aside)
    for name in RUN_FILES:
        if os.path.exists(os.path.join(output_dir, name)):
            os.rename(os.path.join(output_dir, name), os.path.join(aside, name))


def restore_set_aside(output_dir: str) -> bool:
    """Put back a run an --overwrite launch set aside and never replaced (what the failed launch
    wrote goes); whether there was one."""
    aside = os.path.join(output_dir, SET_ASIDE)
    if not os.path.isdir(aside):
        return False
    for name in RUN_FILES:
        current = os.path.join(output_dir, name)
        if os.path.isdir(current):
            shutil.rmtree(current)
        elif os.path.exists(current):
            os.remove(current)
        if os.path.exists(os.path.join(aside, name)):
            os.rename(os.path.join(aside, name), current)
    os.rmdir(aside)
    return True


def drop_set_aside(output_dir: str) -> None:
    """The new run has finished an iteration: the run it replaced goes."""
    shutil.rmtree(os.path.join(output_dir, SET_ASIDE), ignore_errors=True)


def cut_back(path: str, iteration: int) -> None:
    """Keep the records of a JSONL file up to ``iteration`` (a resume redoes the later ones; a torn
    last record goes too)."""
    if not os.path.exists(path):
        return
    kept = [r for r in read_records(path) if r.get("iteration", 0) <= iteration]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in kept)
