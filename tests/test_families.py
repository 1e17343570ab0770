"""Model families (config/families.py): each converts from a tiny random transformers model, runs
at TP=2 and PP=2 with transformers' logits and greedy generate(), converts back to the same
tensors and a config transformers loads as the same model, and every field we do not model is
refused by name before anything is written."""

import json
import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_rlhf.checkpoint.convert import hf_to_megatron  # noqa: E402
from megatron_rlhf.checkpoint.model_files import CheckpointError  # noqa: E402
from tests.helpers.hf_families import (FAMILY_MODELS, assert_outputs_match, assert_round_trip, converted_for_equivalence,  # noqa: E402
                                greedy_cases, make_hf_model)

# The families (and heads) the equivalence worker runs: each family's LM and score head.
CASES = [(name, "lm") for name in FAMILY_MODELS] + [(name, "scalar") for name in ("llama3.1", "qwen2.5", "qwen3", "mistral")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each case's transformers model, converted at TP=1 PP=1, and the worker's results."""
    root = tmp_path_factory.mktemp("families")
    models, ranks = converted_for_equivalence(root, CASES)
    return root, models, ranks


@pytest.mark.parametrize("layout", ["tp2_pp1", "tp1_pp2"])
def test_each_family_gives_transformers_outputs_at_tp2_and_pp2(converted, layout):
    _, models, ranks = converted
    assert_outputs_match(models, ranks, layout, 2 if layout == "tp2_pp1" else 1)


@pytest.mark.parametrize("layout", ["tp2_pp1", "tp1_pp2"])
def test_greedy_generation_equals_transformers_row_by_row(converted, layout):
    _, models, ranks = converted
    lengths = ranks[0].lengths
    for case, model, eos, expected in greedy_cases(models, ranks):
        assert {r[-1] for r in expected if len(r) < 10} == set(eos), case  # each end token ends some row
        if case.startswith("mistral"):
            assert max(lengths) + 10 > 2 * model.config.sliding_window  # the window is crossed
        for r in ranks:
            assert r.generated[(case, layout)] == expected, case


def test_each_family_converts_back_to_the_same_tensors_and_model(converted):
    assert_round_trip(*converted)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "hf"
    make_hf_model("llama3.1", path)
    return path


REFUSED = [  # (model_type, field, value, what the error says)
    ("llama", "attention_bias", True, r"attention_bias: True is not supported \(supported: False\): Llama's attention_bias also biases o_proj"),
    ("llama", "mlp_bias", True, r"mlp_bias: True is not supported \(supported: False\)"),
    ("llama", "hidden_act", "gelu", r"hidden_act: 'gelu' is not supported \(supported: 'silu'\)"),
    ("llama", "pretraining_tp", 2, r"pretraining_tp: 2 is not supported"),
    ("llama", "attention_dropout", 0.1, r"attention_dropout: 0.1 is not supported"),
    ("llama", "partial_rotary_factor", 0.5, r"partial_rotary_factor: not a field of the llama family that we model"),
    ("llama", "sliding_window", 8, r"sliding_window: not a field of the llama family"),
    ("llama", "rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
     r"rope type 'dynamic' is not supported \(supported: default, linear, llama3, yarn\): dynamic NTK"),
    ("llama", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "attention_factor": 1.2,
                                  "original_max_position_embeddings": 64},
     r"rope parameters attention_factor are not supported for rope type 'yarn' \(supported: rope_theta, factor, "
     r"original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, truncate\)"),
    ("llama", "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "attention_factor": 1.0},
     r"rope parameters attention_factor are not supported for rope type 'linear'"),
    ("qwen2", "use_sliding_window", True, r"use_sliding_window: True is not supported"),
    ("qwen2", "layer_types", ["sliding_attention", "full_attention"], r"layer_types: \['full_attention', 'sliding_attention'\]"),
    ("qwen3", "attention_bias", True, r"attention_bias: True is not supported \(supported: False\): Qwen3's"),
    ("gemma", "model_type", "gemma", r"model_type 'gemma' is not supported; supported: llama, qwen2, qwen3, mistral"),
]


@pytest.mark.parametrize("model_type,field,value,message", REFUSED, ids=[f"{r[0]}-{r[1]}-{r[2]}" for r in REFUSED])
def test_each_field_we_do_not_model_is_refused_by_name_before_writing(tmp_path, llama_dir, model_type, field, value, message):
    config = json.loads((llama_dir / "config.json").read_text())
    config["model_type"] = model_type
    config[field] = value
    if field == "rope_parameters":
        config.pop("rope_scaling", None)
    work = tmp_path / "hf"
    work.mkdir()
    for name in os.listdir(llama_dir):
        (work / name).symlink_to(llama_dir / name)
    (work / "config.json").unlink()
    (work / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        hf_to_megatron(str(work), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_tensors_the_config_does_not_declare_are_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    model = make_hf_model("llama3.1", tmp_path / "hf")
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)  # a bias attention_bias: false drops
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensors the llama config.json does not account for: "
                                              r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_tied_checkpoint_may_store_its_head_only_as_the_embedding(tmp_path):
    from safetensors.torch import save_file

    model = make_hf_model("qwen2.5", tmp_path / "hf")
    tensors = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "same"))
    tensors["lm_head.weight"] += 1.0
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tie_word_embeddings is true but lm_head.weight differs"):
        hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "out"))


def test_rope_scaling_equals_transformers_frequencies():
    """Our llama3 / linear / yarn frequencies and YaRN's attention factor against transformers' own
    rope initialisation (Qwen3's 128K setting, DeepSeek's mscale pair, an untruncated ramp, a factor
    read from the windows' ratio)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_rlhf.config.families import arch_from_hf_config
    from megatron_rlhf.models.decoder import make_transformer_config, rope_inv_freq
    from megatron_rlhf.config.schema import ParallelConfig
    from megatron_rlhf.runtime.megatron_compat import rope_attention_factor

    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}
    for params in ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                   {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}, yarn,
                   {**yarn, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
                   {**yarn, "truncate": False}, {**yarn, "factor": None}):
        config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=params,
                                          max_position_embeddings=131072)
        expected, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
        arch = arch_from_hf_config({**config.to_dict(), "intermediate_size": 1, "num_hidden_layers": 1, "vocab_size": 8}, "x")
        assert torch.allclose(rope_inv_freq(arch), expected.float(), rtol=1e-6, atol=0), params
        if params["rope_type"] == "yarn":
            megatron_config = make_transformer_config(arch, ParallelConfig())
            assert rope_attention_factor(megatron_config) == pytest.approx(attention_factor, rel=1e-12), params
    assert rope_attention_factor(make_transformer_config(arch_from_hf_config(
        {**transformers.LlamaConfig(hidden_size=64, num_attention_heads=4).to_dict(), "intermediate_size": 1,
         "num_hidden_layers": 1, "vocab_size": 8}, "x"), ParallelConfig())) == 1.0


def test_a_family_fixes_its_features_in_the_config(tmp_path):
    from megatron_rlhf.config import ConfigError, load_config

    base = os.path.join(os.path.dirname(__file__), "..", "examples", "tiny", "rlhf.yaml")

    def load(model_yaml):
        (tmp_path / "rlhf.yaml").write_text(f"includes: {os.path.abspath(base)}\nreference:\n  model: {model_yaml}\n")
        return load_config(str(tmp_path / "rlhf.yaml"), world_size=2, check_inputs=False)

    qwen3 = load("{preset: qwen3-8b}").role("reference").model
    assert (qwen3.family, qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim) == ("qwen3", True, False, 128)
    llama31 = load("{preset: llama3.1-8b}").role("reference").model
    assert (llama31.rope_scaling, llama31.rotary_base) == ("llama3", 500000.0)
    with pytest.raises(ConfigError, match=r"reference\.model\.qk_norm: False contradicts family 'qwen3', whose "
                                          r"models always have qk_norm: True"):
        load("{preset: qwen3-8b, qk_norm: false}")
    with pytest.raises(ConfigError, match=r"reference\.model\.family: unknown family 'gemma'; supported: llama, qwen2"):
        load("{preset: tiny, family: gemma}")
    with pytest.raises(ConfigError, match=r"reference\.model\.sliding_window: must be >= 1"):
        load("{preset: tiny, family: mistral, sliding_window: 0}")


def test_one_rl_iteration_per_family_at_tp2_is_the_same_with_ems_on_and_off(tmp_path):
    from tests.conftest import run_workers

    ranks = run_workers(tmp_path, 2, "family_iteration")
    for rank in ranks:
        assert sorted(rank.families) == ["llama3.1", "mistral", "qwen2.5", "qwen3"]
        for family, runs in rank.families.items():
            assert runs.on.metrics == runs.off.metrics, family
            assert runs.on.metrics["reward/mean"] > 0, family
            for role, weights in runs.off.weights.items():
                moved = runs.on.weights[role]
                assert sorted(moved) == sorted(weights)
                assert all(torch.equal(moved[k], weights[k]) for k in weights), (family, role)
    qwen = ranks[0].families["qwen2.5"].off.weights["ppo_policy"]
    assert "output_layer.weight" not in qwen and any(k.endswith("linear_qkv.bias") for k in qwen)  # tied, biased
    assert any(k.endswith("q_layernorm.weight") for k in ranks[0].families["qwen3"].off.weights["ppo_policy"])


NEW_PRESETS = {  # MODEL_SIZE: (parameters of the policy in billions, nodes of 8 GPUs by default)
    "llama3.1-8b": (8.03, 1), "llama3.1-70b": (70.55, 4), "qwen2.5-7b": (7.62, 1), "qwen2.5-32b": (32.76, 2),
    "qwen2.5-72b": (72.71, 4), "qwen3-8b": (8.19, 1), "qwen3-32b": (32.76, 2),
}


@pytest.mark.parametrize("size", sorted(NEW_PRESETS))
def test_each_new_preset_plans_to_fit_8_gpus_of_80_gib_per_node(size, monkeypatch, capsys, launch_environment):
    from megatron_rlhf import launch

    launch_environment.update(DRY_RUN="1", MODEL_SIZE=size)
    monkeypatch.setattr(os, "execv", None)  # a dry run never launches
    code = launch.main(["--config", os.path.join("examples", "llama2", "rlhf.yaml")])
    out = capsys.readouterr().out
    billions, nodes = NEW_PRESETS[size]
    assert code == 0
    assert f"{nodes * 8} processes = {nodes} node(s) x 8" in out
    assert re.search(rf"ppo_policy +{re.escape(size)} +{billions:.2f}B +lm", out), out
    assert re.search(r"^fits in 80\.00 GiB", out, re.M), out


def test_a_checkpoint_is_refused_by_a_config_that_would_compute_otherwise(tmp_path):
    import dataclasses

    from megatron_rlhf.checkpoint import load_model_shard
    from megatron_rlhf.checkpoint.model_files import read_model_meta

    make_hf_model("mistral", tmp_path / "hf")
    hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"))
    arch, _ = read_model_meta(str(tmp_path / "mg"))
    assert load_model_shard(str(tmp_path / "mg"), arch, "lm", 1, 0, 1, 0)
    for change, message in ((dict(sliding_window=None), "sliding_window: checkpoint 6 vs config None"),
                            (dict(rotary_base=5e5), "rotary_base: checkpoint 10000.0 vs config 500000.0"),
                            (dict(tie_word_embeddings=True), "tie_word_embeddings: checkpoint False vs config True")):
        with pytest.raises(CheckpointError, match=re.escape(message)):
            load_model_shard(str(tmp_path / "mg"), dataclasses.replace(arch, **change), "lm", 1, 0, 1, 0)
