"""Hugging Face Llama <-> Megatron conversion checked against transformers' own forward."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_rlhf.checkpoint.convert import hf_to_megatron, megatron_to_hf  # noqa: E402
from megatron_rlhf.checkpoint.model_files import CheckpointError  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.helpers.hf_families import all_tensors, hf_outputs, make_hf_model  # noqa: E402


def tiny_hf(path, head, labels: int = 1):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=100, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False, num_labels=labels, pad_token_id=0,
    )
    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM if head == "lm" else transformers.LlamaForSequenceClassification
    model = cls(config).eval()
    with torch.no_grad():  # the score head is zero-initialised; make it informative
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    return model


def test_hf_to_tp2_pp2_matches_transformers_and_converts_back_exactly(tmp_path, workers):
    """A tied Qwen2.5 LM (under PP the last stage holds its copy of the embedding) and a Llama-2
    score head: converted to TP=2 x PP=2, both run in one launch of 4 processes."""
    cases = {}
    for family, head in (("qwen2.5", "lm"), ("llama2", "scalar")):
        hf_dir, mg_dir = tmp_path / f"{family}_hf", tmp_path / f"{family}_mg"
        model = tiny_hf(hf_dir, head) if family == "llama2" else make_hf_model(family, hf_dir, head)
        hf_to_megatron(str(hf_dir), str(mg_dir), tp=2, pp=2)
        cases[family] = (model, head, hf_dir, mg_dir)
    results = workers(4, "checkpoint_forward", *(str(c[3]) for c in cases.values()), "2", "2")
    tokens = results[0].tokens
    for family, (model, head, hf_dir, mg_dir) in cases.items():
        expected = hf_outputs(model, tokens, head)
        got = [r.outputs[str(mg_dir)] for r in results if r.outputs[str(mg_dir)] is not None]
        assert len(got) == 2, family  # the two TP ranks of the last stage
        for g in got:
            assert (g - expected).abs().max().item() <= 1e-4, family
        back_dir = tmp_path / f"{family}_back"
        megatron_to_hf(str(mg_dir), str(back_dir))
        original, back = all_tensors(hf_dir), all_tensors(back_dir)
        assert sorted(back) == sorted(original)
        assert all(torch.equal(back[k], original[k]) for k in original), family
        config = json.loads((back_dir / "config.json").read_text())
        reloaded = type(model).from_pretrained(back_dir)
        assert config["num_key_value_heads"] == 2
        assert torch.allclose(hf_outputs(reloaded.eval(), tokens, head), expected, atol=1e-6), family


def test_a_checkpoint_written_at_one_layout_loads_at_another(tmp_path, workers):
    hf_dir, mg_dir = tmp_path / "hf", tmp_path / "mg"
    model = tiny_hf(hf_dir, "lm")
    hf_to_megatron(str(hf_dir), str(mg_dir), tp=1, pp=2)
    results = workers(2, "checkpoint_forward", str(mg_dir), "2", "1")  # resharded on load
    expected = hf_outputs(model, results[0].tokens, "lm")
    for r in results:
        assert (r.outputs[str(mg_dir)] - expected).abs().max().item() <= 1e-4


def test_truncated_or_mismatched_input_is_refused_before_writing(tmp_path):
    hf_dir = tmp_path / "hf"
    tiny_hf(hf_dir, "lm")
    weights = hf_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor .* needs \d+ bytes, the file has \d+"):
        hf_to_megatron(str(hf_dir), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    weights.write_bytes(data)
    config = json.loads((hf_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \[128, 64\], config\.json implies \[96, 64\]"):
        hf_to_megatron(str(hf_dir), str(tmp_path / "out"))
    config["intermediate_size"] = 128
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="TP=3 does not divide num_attention_heads=4"):
        hf_to_megatron(str(hf_dir), str(tmp_path / "out"), tp=3)
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match="exists; choose another output or pass --overwrite"):
        hf_to_megatron(str(hf_dir), str(tmp_path / "out"))


def test_converters_have_help():
    import subprocess
    import sys

    for tool in ("convert_hf_to_megatron.py", "convert_megatron_to_hf.py"):
        proc = subprocess.run([sys.executable, f"tools/{tool}", "--help"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
        assert proc.returncode == 0 and "--output" in proc.stdout


def test_the_converter_never_deletes_its_input_and_reads_exactly_the_indexed_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_dir = tmp_path / "hf"
    tiny_hf(hf_dir, "lm")
    before = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
    for output, words in ((hf_dir, "it is the input"), (tmp_path, "it contains the input"),
                          (hf_dir / "mg", "it lies inside the input")):
        with pytest.raises(CheckpointError, match=f"refusing to write .*: {words}"):
            hf_to_megatron(str(hf_dir), str(output), overwrite=True)
    assert {p.name: p.read_bytes() for p in hf_dir.iterdir()} == before
    # A second variant beside the model (fp16 weights and their index): only the main index's files
    # are read; without a main index, the directory is ambiguous and refused naming the files.
    weights = load_file(str(hf_dir / "model.safetensors"))
    save_file({k: torch.zeros_like(v).half() for k, v in weights.items()}, str(hf_dir / "model.fp16.safetensors"))
    (hf_dir / "model.fp16.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model.fp16.safetensors" for k in weights}}))
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "model.safetensors" for k in weights}}))
    hf_to_megatron(str(hf_dir), str(tmp_path / "mg"))
    from megatron_rlhf.checkpoint.model_files import read_model_meta

    assert read_model_meta(str(tmp_path / "mg"))[1]["dtype"] == "float32"
    (hf_dir / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="weight indexes model.fp16.safetensors.index.json but none of"):
        hf_to_megatron(str(hf_dir), str(tmp_path / "mg2"))
    (hf_dir / "model.fp16.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match=r"several weight files \(model.fp16.safetensors, model.safetensors\)"):
        hf_to_megatron(str(hf_dir), str(tmp_path / "mg2"))
    (hf_dir / "model.fp16.safetensors").unlink()
    # A NaN weight: refused naming the file and the tensor; nothing written.
    weights["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(weights, str(hf_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor model.layers.1.mlp.up_proj.weight holds NaN"):
        hf_to_megatron(str(hf_dir), str(tmp_path / "mg3"))
    assert not (tmp_path / "mg3").exists()


def test_a_converted_checkpoint_carries_a_manifest_and_a_damaged_one_is_refused_before_start_up(tmp_path):
    from megatron_rlhf.checkpoint.model_files import MANIFEST, verify_checkpoint
    from megatron_rlhf.config import ConfigError, load_config
    from megatron_rlhf.startup import _check_loaded_checkpoints

    tiny_hf(tmp_path / "hf", "lm")
    hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2)
    manifest = json.loads((tmp_path / "mg" / MANIFEST).read_text())["files"]
    assert any(name.endswith("model_optim_rng.pt") for name in manifest) and "megatron_rlhf_model.json" in manifest
    verify_checkpoint(str(tmp_path / "mg"))
    shard = next((tmp_path / "mg").rglob("model_optim_rng.pt"))
    shard.write_bytes(shard.read_bytes()[:-100])
    from tests.test_config import tiny_setup

    config = load_config(str(tiny_setup(tmp_path / "cfg")), world_size=1)
    config.reference.load = str(tmp_path / "mg")
    with pytest.raises(ConfigError, match=r"reference.load: .*model_optim_rng.pt: \d+ bytes, the manifest says \d+"):
        _check_loaded_checkpoints(config)


def test_an_exported_model_carries_its_tokenizer_and_generation_config(tmp_path):
    from tests.helpers.hf_tokenizer import make_tokenizer_dir

    tiny_hf(tmp_path / "hf", "lm")
    hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"))
    tokenizer = make_tokenizer_dir(tmp_path / "tok", generation_eos=["<|im_end|>", "<|endoftext|>"])
    megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "out"), tokenizer=str(tokenizer))
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded.chat_template and json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    with pytest.raises(CheckpointError, match="--tokenizer .*: none of tokenizer.json"):
        megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "out2"), tokenizer=str(tmp_path / "mg"))
    assert not (tmp_path / "out2").exists()


def test_a_score_head_of_two_labels_is_refused_as_such(tmp_path):
    # transformers writes neither id2label nor num_labels for its default of two labels.
    tiny_hf(tmp_path / "hf", "scalar", labels=2)
    assert not {"num_labels", "id2label"} & set(json.loads((tmp_path / "hf" / "config.json").read_text()))
    with pytest.raises(CheckpointError, match="a score head of 2 labels; only one label is supported"):
        hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"))
    assert not (tmp_path / "mg").exists()


def test_a_path_that_is_not_a_model_checkpoint_is_named_for_what_it_is(tmp_path):
    """Where a model checkpoint is expected (a role's load, the converter's --megatron-dir): a path
    that does not exist, a run's output directory, its `latest` pointer, an iteration folder (its
    roles named), a Hugging Face directory, each said as what it is, with what to name instead."""
    import subprocess
    import sys

    from megatron_rlhf.config.validation import not_a_model_checkpoint

    run = tmp_path / "run"
    iteration = run / "checkpoints" / "iter_0000002"
    for role in ("ppo_policy", "ppo_value"):
        (iteration / role).mkdir(parents=True)
        (iteration / role / "megatron_rlhf_model.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("iter_0000002")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    cases = {
        tmp_path / "no" / "ckpt": f"{tmp_path}/no/ckpt: no such file or directory ({tmp_path}/no does not exist either)",
        run: f"{run} is a run's output directory, not a model checkpoint: name a trained role's directory in its latest "
             f"checkpoint, {iteration}/<role>",
        run / "checkpoints" / "latest": f"{run}/checkpoints/latest is a run's pointer to its newest checkpoint: name a "
                                        f"trained role's directory in it, {iteration}/<role>",
        iteration: f"{iteration} holds the model checkpoints of ppo_policy, ppo_value (a run checkpoint's iteration "
                   f"folder): name one of them, e.g. {iteration}/ppo_policy",
        tmp_path / "hf": f"{tmp_path}/hf is a Hugging Face model directory (no megatron_rlhf_model.json); write one with "
                         "tools/convert_hf_to_megatron.py",
    }
    for path, said in cases.items():
        assert not_a_model_checkpoint(str(path)) == said
    converted = subprocess.run([sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py"), "--megatron-dir",
                                str(run / "checkpoints" / "latest"), "--output", str(tmp_path / "out")],
                               capture_output=True, text=True)
    assert converted.returncode == 2 and converted.stderr == \
        f"error: --megatron-dir: {cases[run / 'checkpoints' / 'latest']}\n"
