"""LoRA (models/lora.py): adapters on megatron's tensor-parallel linears equal the merged base and
do not depend on TP or PP; only the adapters train; the reference is the base and costs nothing."""

import pytest

from megatron_rlhf.models.lora import is_adapter


def test_adapters_equal_the_merged_base_and_do_not_depend_on_tp_or_pp(workers):
    for r in workers(2, "lora"):
        assert r["b0_equal"] and r["off_equal"]  # B = 0, and adapters off: the base's logits exactly
        assert r["lora_moves"] > 0.1 and r["merged"] <= 1e-5  # W + alpha/rank B A
        assert r["base_without_grads"]
        for layout in ("tp2_pp1", "tp1_pp2"):
            assert r[f"{layout}_a_init"], layout  # A starts the same at every layout
            assert r[f"{layout}_logits"] is None or r[f"{layout}_logits"] <= 1e-5, layout  # None: not the last stage
            assert r[f"{layout}_grads"] <= 1e-5, layout


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
