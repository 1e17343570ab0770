"""Megatron model checkpoints on disk, and reading Hugging Face checkpoint files tensor by tensor.

Layout of a model checkpoint directory (Megatron-LM's own, so its tools recognise it):
  latest_checkpointed_iteration.txt      "release"
  megatron_rlhf_model.json               architecture, head, dtype, TP and PP it was written at
  release/mp_rank_TT[_PPP]/model_optim_rng.pt   {"model": that rank's state dict}
Every directory is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import shutil
import struct
import zlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_rlhf.config.loader import read_checkpoint_meta
from megatron_rlhf.config.presets import CHECKPOINT_META_FILE
from megatron_rlhf.config.schema import TRAINING_ONLY_ARCH_FIELDS, ModelArchConfig
from megatron_rlhf.models.sharding import StateDict, experts_of_rank, merge_tensor, shard_state_dict


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated or does not fit; the message names the file."""


# --------------------------------------------------------------------------------------------------
# Atomic directories


def write_atomically(final_dir: str, fill: Callable[[str], None], overwrite: bool = False,
                     inputs: Sequence[str] = ()) -> None:
    """Run ``fill(tmp_dir)`` and rename the finished directory to ``final_dir``. A failure
    leaves ``final_dir`` as it was (absent, or the old contents) and removes the partial one.
    An output that is, contains or lies inside one of ``inputs`` is refused before anything."""
    final_dir = os.path.abspath(final_dir)
    for source in inputs:
        overlap = _overlap(final_dir, source)
        if overlap:
            raise CheckpointError(f"refusing to write {final_dir}: it {overlap} the input {os.path.realpath(source)}, "
                                  "which replacing it would delete; choose an output outside the input")
    if os.path.exists(final_dir) and not overwrite:
        raise CheckpointError(f"{final_dir} exists; choose another output or pass --overwrite")
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(final_dir)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        fill(tmp)
        _apply_umask(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final_dir):
        old = tmp + ".old"
        os.rename(final_dir, old)
        os.rename(tmp, final_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final_dir)


MANIFEST = "manifest.json"
# The checkpoint format this version writes and reads (manifest.json's "version"): 2 is the first
# versioned one (a run checkpoint's trainer state of tensors and plain types, loaded weights_only).
# A manifest without a version is format 1: model files read as ever, run checkpoints refused.
FORMAT_VERSION = 2
FORMAT_NAME = "megatron-rlhf"


def _checksum(path: str) -> int:
    value = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            value = zlib.crc32(chunk, value)
    return value


def manifest_of(files: Dict[str, Dict[str, int]]) -> dict:
    """manifest.json's content for ``files`` (name -> bytes and crc32), in this version's format."""
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "files": files}


def _files_under(root: str) -> List[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names)


def write_manifest(root: str) -> None:
    """manifest.json: every file under ``root`` with its size and CRC-32 (written last: a
    directory with a manifest is complete)."""
    files = _files_under(root)
    manifest = {f: {"bytes": os.path.getsize(os.path.join(root, f)), "crc32": _checksum(os.path.join(root, f))}
                for f in files if f != MANIFEST}
    with open(os.path.join(root, MANIFEST), "w") as out:
        json.dump(manifest_of(manifest), out, indent=0)


def read_manifest(path: str) -> Tuple[int, Dict[str, Dict[str, int]]]:
    """(format version, name -> bytes and crc32) of checkpoint ``path``'s manifest; a format this
    version does not know (another program's, or a newer version's) refused by name."""
    manifest_file = os.path.join(path, MANIFEST)
    try:
        with open(manifest_file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{manifest_file}: unreadable ({e}); the checkpoint is incomplete") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_file}: not a megatron-rlhf manifest (a JSON object of files)")
    if "version" not in manifest and "files" not in manifest:
        return 1, manifest  # format 1: the files at the top level
    version, name = manifest.get("version"), manifest.get("format")
    if name != FORMAT_NAME or not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{manifest_file}: format {name!r} version {version!r} is not a megatron-rlhf checkpoint "
                              f"format; this version reads format {FORMAT_VERSION} ({FORMAT_NAME!r})")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{manifest_file}: checkpoint format version {version} is newer than this megatron-rlhf "
                              f"reads ({FORMAT_VERSION}); use the version that wrote it, or a newer one")
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_file}: no 'files' object")
    return version, manifest["files"]


def verify_checkpoint(path: str, checksums: bool = True) -> int:
    """Raise CheckpointError naming the first file of checkpoint ``path`` that is missing, of
    another size or (with ``checksums``) other content than its manifest says, or that the
    manifest does not list (it would be read unchecked); its format version."""
    version, files = read_manifest(path)
    unlisted = [f for f in _files_under(path) if f != MANIFEST and f not in files]
    if unlisted:
        raise CheckpointError(f"{os.path.join(path, unlisted[0])}: not in the checkpoint's manifest (added or its entry "
                              f"removed after the checkpoint was written), so it would be read unchecked; remove it, "
                              f"or restore the manifest{f' ({len(unlisted)} such files)' if len(unlisted) > 1 else ''}")
    for name, expected in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing")
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {expected['bytes']} (truncated or replaced)")
        if checksums and _checksum(file) != expected["crc32"]:
            raise CheckpointError(f"{file}: its content differs from the manifest's checksum (corrupted)")
    return version


def load_plain(path: str, mmap: bool = False):
    """A checkpoint file's content, tensors and plain types only (torch's ``weights_only``): a
    file that holds anything else (a pickled callable) is refused without running it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0][:300]
        raise CheckpointError(f"{path}: holds objects other than tensors and plain types, refused without loading "
                              f"them (a checkpoint written by megatron-rlhf never does: it was altered) [{first}]") from None


def check_readable(path: str) -> None:
    """Raise CheckpointError naming the first file of checkpoint ``path`` (one without a manifest)
    that cannot be read: a torch file whose archive is cut short, a safetensors file whose header
    or data is."""
    import zipfile

    for directory, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            file = os.path.join(directory, name)
            try:
                if name.endswith(".pt"):
                    with zipfile.ZipFile(file) as archive:  # torch.save's format: the index is at the end
                        archive.infolist()
                elif name.endswith(".safetensors"):
                    from safetensors import safe_open

                    with safe_open(file, framework="pt"):
                        pass
            except Exception as e:  # zipfile's and safetensors' own errors: a damaged or truncated file
                raise CheckpointError(f"{file}: damaged or truncated ({e})") from None


def _overlap(output: str, source: str) -> str:
    """How ``output`` overlaps the directory ``source`` ("is", "contains", "lies inside"), or ""."""
    out, src = os.path.realpath(output), os.path.realpath(source)
    if out == src:
        return "is"
    if src.startswith(out.rstrip(os.sep) + os.sep):
        return "contains"
    if out.startswith(src.rstrip(os.sep) + os.sep):
        return "lies inside"
    return ""


def _apply_umask(root: str) -> None:
    """Every file and directory under ``root`` with the modes a plain open() would give them
    (writers such as safetensors, and the private temporary directory, use 0600/0700)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for directory, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(directory, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o666 & ~umask)


# --------------------------------------------------------------------------------------------------
# Megatron model checkpoints


def shard_file(root: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    return os.path.join(root, "release", name, "model_optim_rng.pt")


def write_model_meta(root: str, arch: ModelArchConfig, head: str, dtype: torch.dtype, tp: int, pp: int,
                     lora: Optional[dict] = None, records: Optional[dict] = None) -> None:
    """``lora``: the adapters the shards hold beside the base (rank, alpha, target_modules), if any.
    ``records``: what a trained role's checkpoint records beside its weights: ``scores`` (a reward
    model's score statistics on held-out pairs: mean, std, pairs; stage rm), which PPO's
    reward.normalize reads, and ``tokenizer`` (data/tokenizer.py: Tokenizer.record), which a run that
    loads it checks its own against."""
    meta = {"arch": dataclasses.asdict(arch), "head": head, "dtype": str(dtype).replace("torch.", ""), "tp": tp, "pp": pp}
    if lora:
        meta["lora"] = lora
    meta.update({k: v for k, v in (records or {}).items() if v})
    with open(os.path.join(root, CHECKPOINT_META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")


def save_shard(root: str, tp_rank: int, pp_rank: int, pp_size: int, state: StateDict) -> None:
    path = shard_file(root, tp_rank, pp_rank, pp_size)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": state, "checkpoint_version": 3.0}, path)


def read_model_meta(root: str) -> Tuple[ModelArchConfig, dict]:
    try:
        meta = read_checkpoint_meta(root)
    except FileNotFoundError:
        raise CheckpointError(f"{root}: not a megatron-rlhf model checkpoint (no {CHECKPOINT_META_FILE})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{os.path.join(root, CHECKPOINT_META_FILE)}: not valid JSON ({e.msg})") from None
    return ModelArchConfig(**meta["arch"]), meta


def recorded_scores(root: str) -> Tuple[float, float]:
    """(mean, std) of the scores a reward model's checkpoint records (stage rm's held-out pairs)."""
    scores = read_model_meta(root)[1].get("scores")
    if not scores:
        raise CheckpointError(f"{root}: records no score statistics (a reward model trained by stage rm with "
                              "data.val_file records the mean and std of its held-out scores)")
    mean, std = scores.get("mean"), scores.get("std")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (mean, std)) or std <= 0:
        raise CheckpointError(f"{os.path.join(root, CHECKPOINT_META_FILE)}: scores {scores}: the mean and std must be "
                              "finite numbers, the std above 0")
    return float(mean), float(std)


def load_shard(root: str, tp_rank: int, pp_rank: int, pp_size: int) -> StateDict:
    path = shard_file(root, tp_rank, pp_rank, pp_size)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing shard (TP rank {tp_rank}, PP rank {pp_rank})")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["model"]
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable or truncated shard ({e})") from None


def full_tensors(root: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """The full (TP=1, PP=1) state dict of a model checkpoint, one tensor at a time: only one
    stage's shards are mapped (mmap) at once, and one full tensor is built at a time."""
    from megatron_rlhf.models.sharding import stage_layers

    arch, meta = read_model_meta(root)
    tp, pp, head = meta["tp"], meta["pp"], meta["head"]
    for pp_rank in range(pp):
        shards = [load_shard(root, t, pp_rank, pp) for t in range(tp)]
        first_layer = stage_layers(arch.num_layers, pp, pp_rank).start
        for key in shards[0]:
            if key == "output_layer.weight" and arch.tied_output(head):
                continue  # the last stage's copy of the embedding
            if key.startswith("decoder.layers."):
                _, _, number, rest = key.split(".", 3)
                full_key = f"decoder.layers.{int(number) + first_layer}.{rest}"
            else:
                full_key = key
            yield full_key, merge_tensor(key, [s[key] for s in shards], arch.vocab_size, head)
        del shards


def load_model_shard(root: str, arch: ModelArchConfig, head: str, tp: int, tp_rank: int, pp: int, pp_rank: int,
                     ep: int = 1, ep_rank: int = 0, padded_vocab: Optional[int] = None) -> StateDict:
    """This rank's state dict for layout (tp, pp, ep) from a checkpoint written at any layout (a
    checkpoint's shards hold every expert of their stage: the EP cut is made here). ``padded_vocab``:
    the model's output rows (default: padded for ``tp``)."""
    state = _tp_pp_shard(root, arch, head, tp, tp_rank, pp, pp_rank, padded_vocab or arch.padded_vocab_size(tp))
    return experts_of_rank(state, arch.num_experts, ep, ep_rank) if arch.num_experts else state


def _tp_pp_shard(root: str, arch: ModelArchConfig, head: str, tp: int, tp_rank: int, pp: int, pp_rank: int,
                 padded: int) -> StateDict:
    saved_arch, meta = read_model_meta(root)
    differs = [f"{f}: checkpoint {saved} vs config {mine}" for f, saved, mine in _computation_fields(saved_arch, arch)
               if saved != mine]
    if differs or meta["head"] != head:
        raise CheckpointError(
            f"{root}: does not fit the configured model: "
            + "; ".join(differs + ([f"head: checkpoint {meta['head']} vs role {head}"] if meta["head"] != head else []))
        )
    if (meta["tp"], meta["pp"]) == (tp, pp) and saved_arch.padded_vocab_size(tp) == padded:
        return dict(load_shard(root, tp_rank, pp_rank, pp))
    # Another layout: rebuild the full tensors and cut this rank's piece (reads every shard).
    out: StateDict = {}
    for key, tensor in full_tensors(root):
        out.update(shard_state_dict({key: tensor}, arch.num_layers, padded, tp, tp_rank, pp, pp_rank, head=head,
                                    tied=arch.tied_output(head)))
    return out


# The fields that change what a model computes (not its initialisation, padding, preset or the
# longest sequence it was told of), compared between a checkpoint and the config that loads it.
_NOT_COMPUTATION = ("preset", "family", "num_query_groups", "head_dim", "init_method_std",
                    "make_vocab_size_divisible_by", "max_position_embeddings") + TRAINING_ONLY_ARCH_FIELDS


def _computation_fields(saved: ModelArchConfig, configured: ModelArchConfig) -> List[Tuple[str, object, object]]:
    out = [("num_query_groups", saved.kv_groups, configured.kv_groups), ("head_dim", saved.kv_channels, configured.kv_channels)]
    for field in dataclasses.fields(ModelArchConfig):
        if field.name not in _NOT_COMPUTATION:
            out.append((field.name, getattr(saved, field.name), getattr(configured, field.name)))
    return out


# --------------------------------------------------------------------------------------------------
# Hugging Face checkpoint files


def _safetensors_header(path: str) -> Dict[str, dict]:
    """The tensor table of a .safetensors file, checked against the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated (no safetensors header)")
        (length,) = struct.unpack("<Q", raw)
        if 8 + length > size:
            raise CheckpointError(f"{path}: truncated (header of {length} bytes, file of {size})")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + length + end > size:
        last = max(header, key=lambda n: header[n]["data_offsets"][1])
        raise CheckpointError(f"{path}: truncated: tensor {last} needs {8 + length + end} bytes, the file has {size}")
    return header


MAIN_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _weight_files(directory: str, names: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(safetensors files, .bin files) holding the model: exactly those the main index names, or
    the one unindexed file; a directory where that is ambiguous (several indexes but no main one,
    several unindexed weight files) is refused, naming the files."""
    index = next((n for n in MAIN_INDEXES if n in names), None)
    if index:
        try:
            with open(os.path.join(directory, index)) as f:
                listed = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{os.path.join(directory, index)}: not a readable weight index ({e})") from None
        missing = [n for n in listed if n not in names]
        if missing:
            raise CheckpointError(f"{os.path.join(directory, index)}: names files that are missing: {', '.join(missing)}")
        return ([n for n in listed if n.endswith(".safetensors")], [n for n in listed if n.endswith(".bin")])
    others = sorted(n for n in names if n.endswith(".index.json"))
    if others:
        raise CheckpointError(f"{directory}: weight indexes {', '.join(others)} but none of {', '.join(MAIN_INDEXES)}: "
                              "which variant is the model is ambiguous; keep one variant's files (or name its index "
                              "model.safetensors.index.json)")
    safetensors = sorted(n for n in names if n.endswith(".safetensors"))
    bins = sorted(n for n in names if n.endswith(".bin") and n.startswith("pytorch_model"))
    for found in (safetensors, bins):
        if len(found) > 1:
            raise CheckpointError(f"{directory}: several weight files ({', '.join(found)}) and no index naming them: "
                                  "which hold the model is ambiguous; add the model's index or keep one variant")
    return safetensors, bins


class HFCheckpointReader:
    """Tensors of a Hugging Face model directory (safetensors or .bin, sharded or not), read one
    at a time; shapes are known before any tensor data is read."""

    def __init__(self, directory: str):
        self.directory = directory
        self.files: Dict[str, str] = {}  # tensor name -> file
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        self._open: Dict[str, object] = {}
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory}: no such directory")
        names = os.listdir(directory)
        safetensors, bins = _weight_files(directory, names)
        if safetensors:
            for name in safetensors:
                path = os.path.join(directory, name)
                for tensor, info in _safetensors_header(path).items():
                    self.files[tensor], self.shapes[tensor] = path, tuple(info["shape"])
        elif bins:
            for name in bins:
                path = os.path.join(directory, name)
                state = self._load_bin(path)
                for tensor, value in state.items():
                    self.files[tensor], self.shapes[tensor] = path, tuple(value.shape)
        else:
            raise CheckpointError(f"{directory}: no *.safetensors or pytorch_model*.bin files")

    def _load_bin(self, path: str):
        if path not in self._open:
            try:
                self._open[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise CheckpointError(f"{path}: unreadable or truncated ({e})") from None
        return self._open[path]

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path.endswith(".bin"):
            return self._load_bin(path)[name]
        from safetensors import safe_open

        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_tensor(name)

    def check(self, expected: Dict[str, Tuple[int, ...]]) -> None:
        """Every expected tensor present with its shape, else an error naming file and tensor."""
        for name, shape in expected.items():
            if name not in self.files:
                raise CheckpointError(f"{self.directory}: tensor {name} is missing")
            if self.shapes[name] != tuple(shape):
                raise CheckpointError(
                    f"{self.files[name]}: tensor {name} has shape {list(self.shapes[name])}, "
                    f"config.json implies {list(shape)}"
                )
