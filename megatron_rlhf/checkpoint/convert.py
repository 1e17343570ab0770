"""Hugging Face <-> Megatron model checkpoints of every family in config/families.py, at any TP/PP,
streaming tensor by tensor.

hf_to_megatron writes one (TP rank, PP rank) shard at a time, reading each Hugging Face tensor
from its memory-mapped file when that shard needs it, so host memory holds about one shard plus
one full tensor. megatron_to_hf maps one pipeline stage's shards (mmap) and writes one safetensors
file per transformer layer.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch

from megatron_rlhf.checkpoint import hf_decoder
from megatron_rlhf.config.families import arch_from_hf_config, hf_config_from_arch
from megatron_rlhf.checkpoint.model_files import (
    CheckpointError,
    HFCheckpointReader,
    full_tensors,
    read_model_meta,
    save_shard,
    write_atomically,
    write_manifest,
    write_model_meta,
)
from megatron_rlhf.models.lora import arch_blocks, delta_weight
from megatron_rlhf.models.sharding import shard_state_dict, stages_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=None)


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; a Hugging Face model directory has a config.json") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg})") from None


def detect_head(hf_config: dict) -> str:
    architectures = hf_config.get("architectures") or ["ForCausalLM"]
    return "scalar" if any("SequenceClassification" in a for a in architectures) else "lm"


def check_tensors(reader: HFCheckpointReader, arch, head: str) -> None:
    """Every tensor the architecture needs, with its shape, and nothing else: a tensor we would not
    read (a bias, a norm of a feature the config does not declare) is an error naming it."""
    expected = hf_decoder.expected_hf_shapes(arch, head)
    reader.check(expected)
    unexpected = sorted(n for n in reader.files if n not in expected and not hf_decoder.DERIVED_HF_TENSORS.match(n))
    if arch.tied_output(head) and "lm_head.weight" in unexpected:
        # Some tied checkpoints store the head anyway; it must be the embedding.
        if not torch.equal(reader.get("lm_head.weight"), reader.get("model.embed_tokens.weight")):
            raise CheckpointError(f"{reader.files['lm_head.weight']}: tie_word_embeddings is true but lm_head.weight "
                                  "differs from model.embed_tokens.weight")
        unexpected.remove("lm_head.weight")
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
        raise CheckpointError(f"{reader.directory}: tensors the {arch.family} config.json does not account for: {shown}")


def hf_to_megatron(
    hf_dir: str,
    output: str,
    tp: int = 1,
    pp: int = 1,
    head: Optional[str] = None,
    dtype: Optional[str] = None,
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
) -> None:
    config = read_hf_config(hf_dir)
    head = head or detect_head(config)
    arch = arch_from_hf_config(config, os.path.join(hf_dir, "config.json"))
    arch.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    # transformers writes id2label (num_labels is a property of it), and neither when it is its
    # default of two labels.
    labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)
    if head == "scalar" and labels != 1:
        raise CheckpointError(f"{hf_dir}/config.json: a score head of {labels} labels; only one label is supported "
                              "(a reward or value model gives one scalar score)")
    for size, what in ((arch.num_attention_heads, "num_attention_heads"), (arch.kv_groups, "num_key_value_heads"),
                       (arch.ffn_hidden_size, "intermediate_size")):
        if size % tp:
            raise CheckpointError(f"TP={tp} does not divide {what}={size}")
    if arch.num_layers % pp:
        raise CheckpointError(f"PP={pp} does not divide num_hidden_layers={arch.num_layers}")
    reader = HFCheckpointReader(hf_dir)
    check_tensors(reader, arch, head)  # before anything is written
    torch_dtype = DTYPES[dtype] if dtype else reader.get("model.embed_tokens.weight").dtype
    keys = hf_decoder.megatron_keys(arch, head)
    padded, tied = arch.padded_vocab_size(tp), arch.tied_output(head)

    def finite(name: str) -> torch.Tensor:
        tensor = reader.get(name)
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{reader.files[name]}: tensor {name} holds NaN or infinite values; the checkpoint "
                                  "is damaged (nothing was written)")
        return tensor

    def fill(tmp: str) -> None:
        bar = _progress(len(keys) * tp, f"HF -> Megatron TP={tp} PP={pp}")
        for pp_rank in range(pp):
            stage_keys = [k for k in keys if pp_rank in stages_of(k, arch.num_layers, pp, tied)]
            for tp_rank in range(tp):
                shard = {}
                for key in stage_keys:
                    full = hf_decoder.megatron_tensor(key, finite, arch, head).to(torch_dtype)
                    shard.update(shard_state_dict({key: full}, arch.num_layers, padded, tp, tp_rank, pp, pp_rank,
                                                  head=head, tied=tied))
                    bar.update(1)
                save_shard(tmp, tp_rank, pp_rank, pp, shard)
                del shard
        bar.close()
        write_model_meta(tmp, arch, head, torch_dtype, tp, pp)
        write_manifest(tmp)  # last: checked before a run that loads it builds any model

    write_atomically(output, fill, overwrite, inputs=[hf_dir])


# What a Hugging Face directory needs besides the weights to tokenize and generate on its own.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")


def megatron_to_hf(root: str, output: str, dtype: Optional[str] = None, overwrite: bool = False,
                   tokenizer: Optional[str] = None, merge_lora: bool = False) -> None:
    """``tokenizer``: a Hugging Face directory whose TOKENIZER_FILES are copied in (refused before
    anything is written if it holds none of them). A checkpoint with LoRA adapters (a PPO run's)
    needs ``merge_lora``: each adapted weight is written as W + alpha/rank B A."""
    import shutil

    from safetensors.torch import save_file

    arch, meta = read_model_meta(root)
    lora, head = meta.get("lora"), meta["head"]
    if lora and not merge_lora:
        raise CheckpointError(f"{root}: holds LoRA adapters (rank {lora['rank']}) beside its base; --output needs "
                              "--merge-lora (the weights with the adapters merged); --peft-output writes the adapters "
                              "alone as a PEFT adapter")
    if merge_lora and not lora:
        raise CheckpointError(f"{root}: --merge-lora, but the checkpoint holds no LoRA adapters")

    copied = [f for f in TOKENIZER_FILES if tokenizer and os.path.isfile(os.path.join(tokenizer, f))]
    if tokenizer and not copied:
        raise CheckpointError(f"--tokenizer {tokenizer}: none of {', '.join(TOKENIZER_FILES)} there; name the model's "
                              "Hugging Face directory")

    torch_dtype = DTYPES[dtype] if dtype else getattr(torch, meta["dtype"])
    keys = hf_decoder.megatron_keys(arch, head)

    def file_of(key: str) -> int:
        # 0: embeddings; 1..L: transformer layers; L+1: final norm and head.
        if key.startswith("decoder.layers."):
            return int(key.split(".")[2]) + 1
        return 0 if key.startswith("embedding.") else arch.num_layers + 1

    count = arch.num_layers + 2
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]

    def fill(tmp: str) -> None:
        bar = _progress(len(keys), "Megatron -> HF")
        weight_map, pending, current, total_bytes = {}, {}, None, 0
        tensors = full_tensors(root)
        for key, tensor in merged_adapters(tensors, lora, arch) if lora else tensors:
            index = file_of(key)
            if current is not None and index != current:
                save_file(pending, os.path.join(tmp, names[current]), metadata={"format": "pt"})
                pending = {}
            current = index
            for name, part in hf_decoder.hf_tensors(key, tensor, arch, head):
                pending[name] = part.to(torch_dtype).contiguous()
                weight_map[name] = names[index]
                total_bytes += pending[name].numel() * pending[name].element_size()
            bar.update(1)
        if pending:
            save_file(pending, os.path.join(tmp, names[current]), metadata={"format": "pt"})
        bar.close()
        if len(weight_map) != len(hf_decoder.expected_hf_shapes(arch, head)):
            raise CheckpointError(f"{root}: the checkpoint lacks tensors ({len(weight_map)} written)")
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=1)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config_from_arch(arch, head, str(torch_dtype).replace("torch.", "")), f, indent=1)
        for name in copied:
            shutil.copyfile(os.path.join(tokenizer, name), os.path.join(tmp, name))

    write_atomically(output, fill, overwrite, inputs=[root])


# --------------------------------------------------------------------------------------------------
# LoRA adapters (models/lora.py) merged into their weights (PEFT adapter directories: checkpoint/peft.py)


def merged_adapters(tensors, lora: dict, arch):
    """The full tensors of a LoRA checkpoint with each adapted linear's weight as W + alpha/rank B A
    (by projection, models/lora.py) and no adapter tensors (a linear's weight is held back until its
    two adapters have come)."""
    scale = lora["alpha"] / lora["rank"]
    held: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in tensors:
        linear, leaf = key.rsplit(".", 1)
        target = linear.rsplit(".", 1)[-1]
        adapted = target in lora["target_modules"] and key.startswith("decoder.layers.")
        if not adapted or leaf not in ("weight", "lora_a", "lora_b"):
            yield key, tensor
            continue
        parts = held.setdefault(linear, {})
        parts[leaf] = tensor
        if len(parts) == 3:
            del held[linear]
            delta = scale * delta_weight(parts["lora_a"].double(), parts["lora_b"].double(), *arch_blocks(target, arch))
            yield linear + ".weight", (parts["weight"].double() + delta).to(parts["weight"].dtype)
    if held:
        raise CheckpointError(f"LoRA checkpoint: {sorted(held)[0]} lacks its weight or an adapter")
