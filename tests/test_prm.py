"""Process reward models (stage prm): the loss, accuracy and gradients against TRL's PRMTrainer on the
same weights and rows, the stepwise shapes read, and each bad row refused by file and line."""

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

TRL_PRM = Path(sys.prefix) / "peers" / "trl-0.29.1"  # make install puts TRL's last PRMTrainer there
ROWS = [  # TRL's stepwise format; texts the tokenizer's corpus covers
    {"prompt": "What is 2 + 3?", "completions": ["2 + 3 = 5.", "So the answer is 5."], "labels": [True, True]},
    {"prompt": "What is 4 * 2?", "completions": ["4 * 2 = 6.", "The answer is 6."], "labels": [False, False]},
    {"prompt": "Add 1 and 1.", "completions": ["1 + 1 = 2.", "It is 3.", "So 3."], "labels": [True, False, False]},
    {"prompt": "What is 9 - 4?", "completions": ["9 - 4 = 5."], "labels": [True]},
]
CASES = {  # ours and TRL's settings of each case
    "all_steps": {"step_separator": "\n", "max_length": 64, "train_on_last_step_only": False},
    "last_step_cut": {"step_separator": " ; ", "max_length": 24, "train_on_last_step_only": True},
}


def _models(tmp_path):
    """A two-label token classifier without bias (TRL's model), and the same network as a reward model
    whose score is its logits' difference (ours: the score of label 1 over label 0), converted."""
    import transformers

    from megatron_rlhf.checkpoint.convert import hf_to_megatron
    from tests.helpers.hf_families import FAMILY_MODELS, SHARED

    fields = {**SHARED, **FAMILY_MODELS["llama3.1"][2], "tie_word_embeddings": False, "vocab_size": 320,
              "num_labels": 2, "pad_token_id": 0, "token_classification_bias": False}
    torch.manual_seed(0)
    classifier = transformers.LlamaForTokenClassification(transformers.LlamaConfig(**fields)).eval()
    with torch.no_grad():
        for name, p in classifier.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name else 0.1))
    classifier.save_pretrained(tmp_path / "classifier_hf")
    fields.pop("token_classification_bias")
    reward = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**{**fields, "num_labels": 1}))
    state = {k: v for k, v in classifier.state_dict().items() if not k.startswith("score.")}
    state["score.weight"] = classifier.score.weight[1:] - classifier.score.weight[:1]
    reward.load_state_dict(state)
    reward.save_pretrained(tmp_path / "reward_hf")
    hf_to_megatron(str(tmp_path / "reward_hf"), str(tmp_path / "reward"))


def _tokenizer(tmp_path) -> str:
    from tests.helpers.hf_tokenizer import byte_level_tokenizer_dir

    corpus = " ".join(r["prompt"] + " " + " ".join(r["completions"]) for r in ROWS) + " ; \n"
    return byte_level_tokenizer_dir(tmp_path / "tokenizer", ["<|pad|>", "<|end|>"], "<|end|>", "", corpus)


def _trl(tmp_path, tokenizer: str) -> dict:
    """TRL's figures of every case, in one process with TRL 0.29.1 first on the path."""
    cases = {case: {"output_dir": str(tmp_path / f"trl_{case}"), **settings} for case, settings in CASES.items()}
    for name, value in (("rows.json", ROWS), ("cases.json", cases)):
        (tmp_path / name).write_text(json.dumps(value))
    out = tmp_path / "trl.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TRL_PRM), str(REPO)]), "TRL_EXPERIMENTAL_SILENCE": "1"}
    subprocess.run([sys.executable, str(REPO / "tests/helpers/trl_prm.py"), str(tmp_path / "classifier_hf"), tokenizer,
                    str(tmp_path / "rows.json"), str(tmp_path / "cases.json"), str(out)], env=env, check=True,
                   capture_output=True, timeout=300)
    return torch.load(out)


def test_loss_accuracy_and_gradients_equal_trl_prm_trainer(tmp_path, workers):
    """Every row's step ends scored, and (second case) the last step alone trained, rows cut at
    max_length, a separator of several tokens: the training loss, the evaluation's loss and accuracy
    and every gradient equal TRL's PRMTrainer (fp32, 1e-5) on the same weights and rows; the score
    head's gradient is TRL's label-1 row's (and minus its label-0 row's)."""
    if not TRL_PRM.is_dir():
        pytest.skip(f"TRL 0.29.1 is not at {TRL_PRM} (make install puts it there)")
    warnings.filterwarnings("ignore")
    _models(tmp_path)
    tokenizer = _tokenizer(tmp_path)
    with open(tmp_path / "rows.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    found = workers(1, "prm_losses", str(tmp_path / "reward"), tokenizer, str(tmp_path / "rows.jsonl"),
                    json.dumps(CASES))[0].cases
    trl = _trl(tmp_path, tokenizer)
    for case in CASES:
        theirs, ours = trl[case], found[case]
        assert ours["ids"] == theirs["input_ids"], case
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5), case
        assert ours["val_loss"] == pytest.approx(theirs["eval_loss"], abs=1e-5), case
        assert ours["val_step_accuracy"] == pytest.approx(theirs["eval_accuracy"], abs=1e-6), case
        head = theirs["grads"].pop("score.weight")
        assert torch.allclose(ours["grads"].pop("score.weight")[0], head[1], atol=1e-6)
        assert torch.allclose(head[0], -head[1], atol=1e-6)
        assert set(ours["grads"]) == set(theirs["grads"])
        for name, grad in ours["grads"].items():
            scale = max(float(theirs["grads"][name].abs().max()), 1e-3)
            assert torch.allclose(grad, theirs["grads"][name], atol=1e-5 * scale, rtol=1e-4), (case, name)


# -- stepwise rows ---------------------------------------------------------------------------------

def _rows(tmp_path, rows, max_length=40, separator=" "):
    from megatron_rlhf.data import CharTokenizer
    from megatron_rlhf.data.steps import StepRows

    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return StepRows(str(path), CharTokenizer("abcdefghijklmnopqrstuvwxyz S12\n+-?:"), max_length, separator)


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "ab ", "completions": ["cd"]}, "no 'labels' column"),
    ({"prompt": "ab ", "completions": ["cd", "ef"], "labels": [True]}, "one label per step (2 steps)"),
    ({"prompt": "ab ", "completions": ["cd", " "], "labels": [True, False]}, "none empty"),
    ({"prompt": "ab ", "completions": "cd", "labels": [True]}, "must be a list of the steps' texts"),
    ({"prompt": "ab ", "completions": ["cd"], "labels": ["yes"]}, "'labels' item 0 must be true/false or 1/0"),
    ({"prompt": [{"role": "user", "content": "ab"}], "completions": ["cd"], "labels": [1]}, "'prompt' must be a string"),
    ({"prompt": "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopq", "completions": ["cd"], "labels": [1]},
     "the prompt alone is 44 tokens"),
    ({"prompt": "ab ", "completions": ["c" * 60], "labels": [1]}, "no step ends within max_length=40"),
    ({"input": "what? step a ки", "label": "what? step a x"}, "with '+' or '-' in place of each"),
    ({"input": "what step a ки", "label": "what step a +"}, "cannot be told apart"),
    ({"input": "what is it", "label": "what is it"}, "has no step tag"),
])
def test_a_bad_stepwise_row_is_refused_naming_file_and_line(tmp_path, row, problem):
    good = {"prompt": "ab ", "completions": ["cd"], "labels": [True]}
    with pytest.raises(ValueError, match=r"steps\.jsonl:3: .*" + re.escape(problem)):
        _rows(tmp_path, [good, good, row])


def test_math_shepherd_rows_read_as_trl_converts_them(tmp_path):
    """A Math-Shepherd row (its tags in 'input', + and - in 'label') reads as the TRL-format row its
    conversion gives: the question up to "Step 1:", the steps between the tags, their labels."""
    shepherd = {"input": "what is a? Step 1: a is b ки\nStep 2: so c ки", "label": "what is a? Step 1: a is b +\nStep 2: so c -"}
    trl = {"prompt": "what is a?", "completions": ["Step 1: a is b", "Step 2: so c"], "labels": [True, False]}
    ours, theirs = _rows(tmp_path, [shepherd]).rows[0], _rows(tmp_path, [trl]).rows[0]
    assert (ours.ids, ours.labels) == (theirs.ids, theirs.labels) and ours.steps == 2
    cut = _rows(tmp_path, [trl], max_length=30).rows[0]  # the second step's end falls beyond: its label is gone
    assert cut.cut and cut.steps == 1 and len(cut.ids) == 30 and not cut.last_step_kept


@pytest.mark.parametrize("overrides, problem", [
    (["data.apply_chat_template=true"], "stage prm reads text rows"),
    (["reward.type=function", "reward.function=x.py:f"], "stage prm trains a reward model: type: model"),
    (["prm.step_separator="], "prm.step_separator: "),
])
def test_a_prm_stage_that_cannot_work_is_refused_by_name(overrides, problem):
    from megatron_rlhf.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(problem)):
        load_config(str(REPO / "examples/tiny_pipeline/prm.yaml"), world_size=2, check_inputs=False, overrides=overrides)
