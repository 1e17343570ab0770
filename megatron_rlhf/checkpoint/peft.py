"""PEFT adapter directories (adapter_config.json + adapter_model.safetensors, the format `peft`
saves and loads) <-> our LoRA adapters (models/lora.py), on the Hugging Face decoders of
checkpoint/hf_decoder.py.

Our fused linears carry one adapter per projection, as PEFT's model has them, so both directions
are exact: linear_qkv's stacked A is q_proj's, k_proj's and v_proj's lora_A in that order and its B
their lora_B rows in megatron's query-group order (the weight's own mapping); linear_fc1's are
gate_proj's and up_proj's. A projection the adapter leaves out (PEFT's default targets q_proj and
v_proj) gets a zero A and B, which stay zero in training (neither receives a gradient): the same
model as PEFT's.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch

from megatron_rlhf.checkpoint import hf_decoder
from megatron_rlhf.checkpoint.model_files import CheckpointError, full_tensors, read_model_meta, write_atomically

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT LoRA features that change what an adapter computes, each with the one value we model.
_UNMODELLED = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none",
               "lora_bias": False, "modules_to_save": None, "layers_to_transform": None, "layer_replication": None,
               "rank_pattern": {}, "alpha_pattern": {}, "target_parameters": None, "trainable_token_indices": None}


def _leaf(projection: str) -> str:
    return projection.rsplit(".", 1)[-1]


def read_peft_config(directory: str, lora) -> dict:
    """``directory``'s adapter_config.json, checked against the run's LoRA settings ``lora``
    (schema.LoRAConfig): every field we do not model at its neutral value, the same rank and alpha,
    and target modules whose projections fall within the run's target_modules. Raises
    CheckpointError naming what differs and what would fit."""
    path = os.path.join(directory, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory}: no {ADAPTER_CONFIG}; name a PEFT adapter directory (as "
                              "PeftModel.save_pretrained or tools/convert_megatron_to_hf.py --peft-output write)")
    if not os.path.isfile(os.path.join(directory, ADAPTER_WEIGHTS)):
        raise CheckpointError(f"{directory}: no {ADAPTER_WEIGHTS} (PEFT's default since 0.6; a pickled "
                              "adapter_model.bin is not read: save it again with safe_serialization=True)")
    try:
        with open(path) as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a JSON object ({e}); a PEFT adapter's config as PeftModel.save_pretrained "
                              "writes it") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: holds {type(config).__name__}, not a JSON object of the adapter's settings")
    problems = [f"{key}: {config[key]!r} (supported: {neutral!r})" for key, neutral in _UNMODELLED.items()
                if key in config and config[key] != neutral and not (neutral in (None, {}, False) and not config[key])]
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        problems.append(f"target_modules: {targets!r} (supported: a list of projection names, e.g. "
                        "[q_proj, k_proj, v_proj, o_proj])")
    else:
        known = {_leaf(p): t for t, (_, projections) in hf_decoder.LINEARS.items() for p in projections}
        unknown = sorted(set(targets) - set(known))
        if unknown:
            problems.append(f"target_modules: {unknown} are not adapter targets (supported: {', '.join(known)})")
        ours = sorted({known[t] for t in targets if t in known})
        if not unknown and set(ours) != set(lora.target_modules):
            problems.append(f"target_modules {sorted(targets)} are on {ours}, but the run's lora.target_modules "
                            f"are {sorted(lora.target_modules)}: set lora.target_modules: {ours}")
    if config.get("r") != lora.rank or float(config.get("lora_alpha", -1)) != lora.alpha:
        problems.append(f"r {config.get('r')}, lora_alpha {config.get('lora_alpha')}, but the run's lora has rank "
                        f"{lora.rank}, alpha {lora.alpha:g}: set lora: {{rank: {config.get('r')}, "
                        f"alpha: {config.get('lora_alpha')}}}")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    return config


def peft_adapters(directory: str, lora, arch, read: bool = True) -> Dict[str, torch.Tensor]:
    """The full (unsharded) lora_a / lora_b tensors of every layer of the model ``arch`` from the
    PEFT adapter in ``directory`` (read_peft_config first), each shape checked and every value
    finite. ``read`` False: the same checks at start-up, nothing kept: {}."""
    from safetensors import safe_open

    config = read_peft_config(directory, lora)
    shapes, rank = hf_decoder.expected_hf_shapes(arch, "lm"), lora.rank
    used, out = set(), {}
    weights = os.path.join(directory, ADAPTER_WEIGHTS)
    try:
        file = safe_open(weights, framework="pt")
    except Exception as e:  # safetensors' own error type: a damaged or truncated file
        raise CheckpointError(f"{weights}: not a readable safetensors file ({e}); the adapter is damaged") from None
    with file:
        names = set(file.keys())

        def factor(layer: int, projection: str, kind: str) -> Optional[torch.Tensor]:
            hf = f"model.layers.{layer}.{projection}"
            out_rows, in_cols = shapes[hf + ".weight"]
            shape = (rank, in_cols) if kind == "A" else (out_rows, rank)
            if _leaf(projection) not in config["target_modules"]:
                return torch.zeros(shape) if read else None
            key = f"{PEFT_PREFIX}{hf}.lora_{kind}.weight"
            if key not in names:
                raise CheckpointError(f"{directory}/{ADAPTER_WEIGHTS}: no {key} (its config targets {_leaf(projection)})")
            if tuple(file.get_slice(key).get_shape()) != shape:
                raise CheckpointError(f"{directory}/{ADAPTER_WEIGHTS}: {key} has shape "
                                      f"{tuple(file.get_slice(key).get_shape())}, the model's needs {shape}: an adapter "
                                      "of another base model?")
            used.add(key)
            tensor = file.get_tensor(key).float()
            if not torch.isfinite(tensor).all():
                raise CheckpointError(f"{weights}: tensor {key} holds NaN or infinite values; the adapter is damaged")
            return tensor if read else None

        for layer in range(arch.num_layers):
            for target in lora.target_modules:
                module, projections = hf_decoder.LINEARS[target]
                module = f"decoder.layers.{layer}.{module}"
                a_parts = [factor(layer, p, "A") for p in projections]
                if not read:
                    for p in projections:
                        factor(layer, p, "B")
                    continue
                out[module + ".lora_a"] = torch.cat(a_parts)
                lora_b = lambda name: factor(layer, name[len(f"model.layers.{layer}."):-len(".weight")], "B")  # noqa: E731
                out[module + ".lora_b"] = hf_decoder.megatron_tensor(module + ".weight", lora_b, arch, "lm")
    unused = sorted(names - used)
    if unused:
        raise CheckpointError(f"{directory}/{ADAPTER_WEIGHTS}: tensors the model has no place for, e.g. "
                              f"{unused[:3]} (a model of {arch.num_layers} layers)")
    return out


def write_peft_adapter(root: str, output: str, overwrite: bool = False, base_model: Optional[str] = None) -> None:
    """The LoRA adapters of checkpoint ``root`` as a PEFT adapter directory that peft loads onto
    the Hugging Face base: a fused linear's adapter becomes its projections' (B's rows cut as the
    weight's are, A's stacked blocks in hf_decoder.LINEARS order)."""
    from safetensors.torch import save_file

    arch, meta = read_model_meta(root)
    lora, head = meta.get("lora"), meta["head"]
    if not lora:
        raise CheckpointError(f"{root}: holds no LoRA adapters (its run trained the whole network); convert it "
                              "with tools/convert_megatron_to_hf.py without --peft-output")
    if head != "lm":
        raise CheckpointError(f"{root}: a value model's adapters come with its score head trained in full, which a "
                              "PEFT adapter does not hold; use --merge-lora")

    def fill(tmp: str) -> None:
        adapters, held, modules = {}, {}, set()
        for key, tensor in full_tensors(root):
            linear, leaf = key.rsplit(".", 1)
            if leaf == "lora_a":
                held[linear] = tensor
            elif leaf == "lora_b":
                projections = list(hf_decoder.hf_tensors(linear + ".weight", tensor, arch, head))
                for (name, b), a in zip(projections, held.pop(linear).chunk(len(projections))):
                    module = PEFT_PREFIX + name[: -len(".weight")]
                    adapters[module + ".lora_A.weight"] = a.contiguous()
                    adapters[module + ".lora_B.weight"] = b.contiguous()
                    modules.add(name.split(".")[-2])
        save_file(adapters, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"],
                  "lora_alpha": lora["alpha"], "lora_dropout": 0.0, "target_modules": sorted(modules), "bias": "none",
                  "fan_in_fan_out": False, "base_model_name_or_path": base_model, "inference_mode": True,
                  "init_lora_weights": True, "modules_to_save": None, "use_rslora": False, "use_dora": False}
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=1)

    write_atomically(output, fill, overwrite, inputs=[root])

