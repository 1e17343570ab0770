"""LoRA (models/lora.py): adapters on megatron's tensor-parallel linears equal the merged base and
do not depend on TP or PP; only the adapters train; the reference is the base and costs nothing;
the adapters export merged into a Hugging Face checkpoint and as a PEFT adapter, both equal to ours."""

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_rlhf.checkpoint.model_files import CheckpointError
from megatron_rlhf.config.schema import LoRAConfig
from megatron_rlhf.models.lora import is_adapter

REPO = Path(__file__).resolve().parent.parent

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """The lora worker's findings on 2 processes, and the directory of the checkpoints it wrote."""
    from tests.conftest import run_workers

    tmp = tmp_path_factory.mktemp("lora")
    return tmp / "lora_2", run_workers(tmp, 2, "lora")  # the worker's directory (conftest.run_workers)


def test_adapters_equal_the_merged_base_and_do_not_depend_on_tp_or_pp(adapted):
    for r in adapted[1]:
        assert r.b0_equal and r.off_equal  # B = 0, and adapters off: the base's logits exactly
        assert r.lora_moves > 0.1 and r.merged <= 1e-5  # W + alpha/rank B A
        assert r.base_without_grads
        for layout in ("tp2_pp1", "tp1_pp2"):
            assert r.a_init[layout], layout  # A starts the same at every layout
            assert r.logits[layout] is None or r.logits[layout] <= 1e-5, layout  # None: not the last stage
            assert r.grads[layout] <= 1e-5, layout


def test_exported_merged_weights_and_peft_adapter_give_our_logits_in_transformers(adapted):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.checkpoint.convert import megatron_to_hf
    from megatron_rlhf.checkpoint.model_files import full_tensors, read_model_meta
    from megatron_rlhf.checkpoint.peft import peft_adapters, write_peft_adapter

    tmp, (r, _) = adapted
    tokens, ours = r.tokens.flatten(0, 1), r.lora_logits.flatten(0, 1)
    megatron_to_hf(str(tmp / "base"), str(tmp / "hf_base"))
    with pytest.raises(CheckpointError, match="holds no LoRA adapters"):
        write_peft_adapter(str(tmp / "base"), str(tmp / "not_written"))
    for layout in ("tp2_pp1", "tp1_pp2"):
        trained = str(tmp / f"lora_{layout}")
        with pytest.raises(CheckpointError, match="holds LoRA adapters .* --output needs --merge-lora"):
            megatron_to_hf(trained, str(tmp / "not_written"))
        megatron_to_hf(trained, str(tmp / f"merged_{layout}"), merge_lora=True)
        write_peft_adapter(trained, str(tmp / f"peft_{layout}"))
        merged = AutoModelForCausalLM.from_pretrained(tmp / f"merged_{layout}", torch_dtype=torch.float32)
        with torch.no_grad():
            theirs = merged(tokens).logits[..., :100]
        assert (theirs - ours).abs().max().item() <= TOLERANCE, layout
        base = AutoModelForCausalLM.from_pretrained(tmp / "hf_base", torch_dtype=torch.float32)
        with_adapter = PeftModel.from_pretrained(base, tmp / f"peft_{layout}")
        with torch.no_grad():
            theirs = with_adapter(tokens).logits[..., :100]
        assert (theirs - ours).abs().max().item() <= TOLERANCE, layout
        # load_lora's reader gives back the checkpoint's adapters exactly.
        arch, meta = read_model_meta(trained)
        back = peft_adapters(str(tmp / f"peft_{layout}"), LoRAConfig(**meta["lora"]), arch)
        saved = {k: v for k, v in full_tensors(trained) if is_adapter(k)}
        assert back.keys() == saved.keys() and all(torch.equal(back[k], saved[k]) for k in saved), layout


def test_the_converter_refuses_a_lora_output_without_merge_before_it_writes_the_adapter(adapted):
    """--peft-output A --output B of a LoRA checkpoint without --merge-lora: one error line naming
    --merge-lora, and A not written (it was written, then the user was told to use --peft-output)."""
    import subprocess
    import sys

    tmp, _ = adapted
    run = subprocess.run([sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py"), "--megatron-dir",
                          str(tmp / "lora_tp2_pp1"), "--peft-output", str(tmp / "adapter_a"), "--output",
                          str(tmp / "merged_b")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, run.stderr
    assert "--output needs --merge-lora" in run.stderr
    assert not (tmp / "adapter_a").exists() and not (tmp / "merged_b").exists()


def test_an_adapter_made_by_peft_loads_as_peft_computes_it(adapted, tmp_path):
    """A PEFT adapter of PEFT's own making (its q and v projections only, each with an A of its own,
    B random) read by load_lora's reader and merged into the base in our layout gives peft's logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.checkpoint import hf_decoder
    from megatron_rlhf.checkpoint.convert import megatron_to_hf, merged_adapters
    from megatron_rlhf.checkpoint.model_files import full_tensors, read_model_meta
    from megatron_rlhf.checkpoint.peft import peft_adapters

    tmp, (r, _) = adapted
    if not (tmp / "hf_base").exists():
        megatron_to_hf(str(tmp / "base"), str(tmp / "hf_base"))
    torch.manual_seed(3)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp / "hf_base", torch_dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                                           init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    tokens = r.tokens.flatten(0, 1)
    with torch.no_grad():
        theirs = peft_model(tokens).logits[..., :100]
    arch, _ = read_model_meta(str(tmp / "base"))
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=["linear_qkv", "linear_proj", "linear_fc2"])
    adapters = peft_adapters(str(tmp_path / "adapter"), lora, arch)
    k_rows = hf_decoder._qkv_to_hf(adapters["decoder.layers.0.self_attention.linear_qkv.lora_b"], arch)[1]
    assert not k_rows.any() and not adapters["decoder.layers.0.self_attention.linear_qkv.lora_a"][4:8].any()
    tensors = list(full_tensors(str(tmp / "base"))) + list(adapters.items())
    merged = {name: t for key, tensor in merged_adapters(tensors, {"rank": 4, "alpha": 8.0, "target_modules":
                                                                   lora.target_modules}, arch)
              for name, t in hf_decoder.hf_tensors(key, tensor, arch, "lm")}
    ours = AutoModelForCausalLM.from_pretrained(tmp / "hf_base", torch_dtype=torch.float32)
    ours.load_state_dict(merged)
    with torch.no_grad():
        assert (ours(tokens).logits[..., :100] - theirs).abs().max().item() <= TOLERANCE


def test_a_peft_adapter_that_does_not_fit_the_run_is_refused_by_what_differs(adapted, tmp_path):
    import json

    from megatron_rlhf.checkpoint.model_files import read_model_meta
    from megatron_rlhf.checkpoint.peft import peft_adapters, write_peft_adapter

    tmp, _ = adapted
    arch, meta = read_model_meta(str(tmp / "lora_tp2_pp1"))
    good = tmp_path / "peft"
    write_peft_adapter(str(tmp / "lora_tp2_pp1"), str(good))
    lora = LoRAConfig(**meta["lora"])
    with pytest.raises(CheckpointError, match=r"rank 8, alpha 8: set lora: \{rank: 4, alpha: 8.0\}"):
        peft_adapters(str(good), LoRAConfig(rank=8, alpha=8.0, target_modules=lora.target_modules), arch)
    with pytest.raises(CheckpointError, match=r"are on \['linear_fc1', 'linear_fc2', 'linear_proj', 'linear_qkv'\], "
                                              r"but the run's lora.target_modules are \['linear_qkv'\]"):
        peft_adapters(str(good), LoRAConfig(rank=4, alpha=8.0, target_modules=["linear_qkv"]), arch)
    config = json.loads((good / "adapter_config.json").read_text())
    (good / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True, "modules_to_save": ["lm_head"]}))
    with pytest.raises(CheckpointError, match=r"use_dora: True \(supported: False\); modules_to_save: \['lm_head'\]"):
        peft_adapters(str(good), lora, arch)
    (good / "adapter_config.json").write_text(json.dumps(config))
    for read in (True, False):  # False: start-up's check, from the file's header
        with pytest.raises(CheckpointError, match="has shape .* an adapter of another base model"):
            peft_adapters(str(good), lora, dataclasses.replace(arch, hidden_size=32, ffn_hidden_size=64), read=read)
    assert peft_adapters(str(good), lora, arch, read=False) == {}
    with pytest.raises(CheckpointError, match="no adapter_config.json; name a PEFT adapter directory"):
        peft_adapters(str(tmp_path), lora, arch)
    # Damaged inputs, each named by its file at start-up (read=False): a config that is not JSON, a
    # weights file cut short, a NaN in an adapter.
    from safetensors.torch import load, save_file

    weights = good / "adapter_model.safetensors"
    whole = weights.read_bytes()
    tensors = load(whole)  # from the bytes: the file is cut below
    (good / "adapter_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"adapter_config.json: not a JSON object \(Expecting property name"):
        peft_adapters(str(good), lora, arch, read=False)
    (good / "adapter_config.json").write_text(json.dumps(config))
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: not a readable safetensors file \(.*"
                                              r"\); the adapter is damaged"):
        peft_adapters(str(good), lora, arch, read=False)
    name = sorted(tensors)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match=f"adapter_model.safetensors: tensor {name} holds NaN or infinite values"):
        peft_adapters(str(good), lora, arch, read=False)


def test_only_the_adapters_train_the_reference_is_the_base_and_resume_is_exact(workers):
    (r,) = workers(1, "lora_run")
    assert r.reference_views and r.reference_owner and r.reference_weight_bytes == 0
    assert r.reference_log_probs_equal
    assert r.base_unchanged and r.adapters_moved
    # Adam's two moments for every adapter element, and its step count per adapter tensor; nothing
    # else (fp32: no main params).
    assert r.optimizer_numel == 2 * r.adapter_numel + r.adapter_tensors and r.adapter_numel < r.base_numel / 5
    assert r.resumed == r.whole[1:]
    assert r.load_lora_equal  # exported as PEFT, started from with load_lora: ppo_policy as it was


def test_adapter_names():
    from megatron_rlhf.checkpoint.hf_decoder import LINEARS
    from megatron_rlhf.config.names import LORA_TARGETS

    assert is_adapter("decoder.layers.0.self_attention.linear_qkv.lora_a")
    assert not is_adapter("decoder.layers.0.self_attention.linear_qkv.weight")
    # The Hugging Face projections of every target, in one table (hf_decoder), for every target.
    assert tuple(LINEARS) == LORA_TARGETS and all(module.endswith(target) for target, (module, _) in LINEARS.items())


def test_adapters_learn_under_activation_recompute_as_without(workers):
    """megatron's recompute over a frozen base: the adapters' gradients equal those without (once
    all zero: the checkpointed blocks' inputs needed no gradient, so nothing in them got one, and the
    run trained nothing in silence; such a pass now stops by name)."""
    import torch

    found = workers(1, "lora_recompute")[0]
    assert found.grad_norms["off"] > 0 and found.grad_norms["on"] == pytest.approx(found.grad_norms["off"], rel=1e-6)
    assert len(found.grads["on"]) == len(found.grads["off"]) > 0
    for name, grad in found.grads["off"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(found.grads["on"][name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert found.unfixed.startswith("pipeline stage 0: the training pass's output needs no gradient, so none of the "
                                    "trained parameters before it would learn"), found.unfixed
