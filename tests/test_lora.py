"""LoRA (models/lora.py): adapters on megatron's tensor-parallel linears equal the merged base and
do not depend on TP or PP; only the adapters train; the reference is the base and costs nothing;
the adapters export merged into a Hugging Face checkpoint and as a PEFT adapter, both equal to ours."""

import pytest
import torch

from megatron_rlhf.checkpoint.model_files import CheckpointError
from megatron_rlhf.models.lora import is_adapter

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """The lora worker's findings on 2 processes, and the directory of the checkpoints it wrote."""
    from tests.conftest import run_workers

    tmp = tmp_path_factory.mktemp("lora")
    return tmp / "lora_2", run_workers(tmp, 2, "lora")  # the worker's directory (conftest.run_workers)


def test_adapters_equal_the_merged_base_and_do_not_depend_on_tp_or_pp(adapted):
    for r in adapted[1]:
        assert r["b0_equal"] and r["off_equal"]  # B = 0, and adapters off: the base's logits exactly
        assert r["lora_moves"] > 0.1 and r["merged"] <= 1e-5  # W + alpha/rank B A
        assert r["base_without_grads"]
        for layout in ("tp2_pp1", "tp1_pp2"):
            assert r[f"{layout}_a_init"], layout  # A starts the same at every layout
            assert r[f"{layout}_logits"] is None or r[f"{layout}_logits"] <= 1e-5, layout  # None: not the last stage
            assert r[f"{layout}_grads"] <= 1e-5, layout


def test_exported_merged_weights_and_peft_adapter_give_our_logits_in_transformers(adapted):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.checkpoint.convert import megatron_to_hf, write_peft_adapter

    tmp, (r, _) = adapted
    tokens, ours = r["tokens"].flatten(0, 1), r["lora_logits"].flatten(0, 1)
    megatron_to_hf(str(tmp / "base"), str(tmp / "hf_base"))
    with pytest.raises(CheckpointError, match="holds no LoRA adapters"):
        write_peft_adapter(str(tmp / "base"), str(tmp / "not_written"))
    for layout in ("tp2_pp1", "tp1_pp2"):
        trained = str(tmp / f"lora_{layout}")
        with pytest.raises(CheckpointError, match="holds LoRA adapters .* pass --merge-lora"):
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


def test_only_the_adapters_train_the_reference_is_the_base_and_resume_is_exact(workers):
    (r,) = workers(1, "lora_run")
    assert r["reference_views"] and r["reference_owner"] and r["reference_weight_bytes"] == 0
    assert r["reference_log_probs_equal"]
    assert r["base_unchanged"] and r["adapters_moved"]
    # Adam's two moments for every adapter element, and its step count per adapter tensor; nothing
    # else (fp32: no main params).
    assert r["optimizer_numel"] == 2 * r["adapter_numel"] + r["adapter_tensors"] and r["adapter_numel"] < r["base_numel"] / 5
    assert r["resumed"] == r["whole"][1:]


def test_adapter_names():
    assert is_adapter("decoder.layers.0.self_attention.linear_qkv.lora_a")
    assert not is_adapter("decoder.layers.0.self_attention.linear_qkv.weight")
