"""The stages before RL (SFT, reward models, DPO): their losses and gradients against TRL's own
trainers and transformers' own loss on the same weights and tokens."""

import copy
import warnings

import pytest
import torch

from megatron_rlhf.checkpoint.convert import hf_to_megatron
from tests.helpers.hf_families import make_hf_model

# (prompt, chosen, rejected, margin) token ids; 0 is padding
PAIRS = [([5, 6, 7], [8, 9, 30], [10], 0.5), ([11, 12], [13], [14, 15, 16, 17], 0.0),
         ([40, 41, 42, 43, 44], [45, 46], [47, 48], -0.25), ([50], [51, 52, 53, 54, 55], [56, 57, 58], 1.0)]
# case -> our settings (the worker's DPOConfig / RMConfig) and TRL's
DPO_CASES = {
    "dpo_sigmoid": (dict(beta=0.2), dict(beta=0.2, loss_type=["sigmoid"])),
    # TRL 1.16's sigmoid loss leaves label smoothing out: conservative DPO is held against its formula below
    "dpo_smoothed": (dict(beta=0.2, label_smoothing=0.1), None),
    "dpo_ipo": (dict(beta=0.3, loss_type="ipo"), dict(beta=0.3, loss_type=["ipo"])),
    "dpo_nll": (dict(beta=0.2, nll_coef=0.5), dict(beta=0.2, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])),
    "dpo_length_normalized": (dict(beta=0.2, length_normalize=True), dict(beta=0.2, loss_type=["sigmoid_norm"])),
}
RM_SETTINGS = dict(center_rewards_coefficient=0.1)


def _batch():
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    rows = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r, _ in PAIRS]
    batch = DataCollatorForPreference(pad_token_id=0)(rows)
    batch["margin"] = torch.tensor([m for *_, m in PAIRS])
    return batch


def _trl_dpo(policy_dir, reference, tokenizer, settings, out_dir):
    """TRL's DPO loss, metrics and gradients on the batch, fp32 (bf16=False: accelerate would run the
    reference under bf16 autocast on a machine that has it)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    data = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    trainer = DPOTrainer(model=model, ref_model=reference, args=DPOConfig(output_dir=str(out_dir), report_to="none",
                                                                         use_cpu=True, bf16=False, **settings),
                         train_dataset=data, processing_class=tokenizer)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, _batch())
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss), metrics, {n: p.grad for n, p in trainer.model.named_parameters()}


def _trl_reward(reward_dir, tokenizer, out_dir):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32)
    trainer = RewardTrainer(model=model, args=RewardConfig(output_dir=str(out_dir), report_to="none", use_cpu=True,
                                                           bf16=False, **RM_SETTINGS),
                            train_dataset=Dataset.from_dict({"chosen": ["a b"], "rejected": ["a c"]}),
                            processing_class=tokenizer)
    trainer.model.config.pad_token_id = 0  # the batch's padding (TRL set the tokenizer's, for its own batches)
    trainer.model.train()
    batch = _batch()
    loss = trainer.compute_loss(trainer.model, {k: batch[k] for k in ("input_ids", "attention_mask", "margin")})
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss), metrics, {n: p.grad for n, p in trainer.model.named_parameters()}


def _conservative_dpo(policy_dir, reference, beta, smoothing):
    """Conservative DPO (Mitchell, eq. 3) written out on transformers' forwards: the loss and gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    batch = _batch()

    def sequence_logps(m):
        logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        tokens = logits.log_softmax(-1).gather(2, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
        return (tokens * batch["completion_mask"][:, 1:]).sum(1)

    with torch.no_grad():
        ref = sequence_logps(reference)
    ratios = sequence_logps(model) - ref
    h = ratios[: len(PAIRS)] - ratios[len(PAIRS):]
    loss = (-(1 - smoothing) * torch.nn.functional.logsigmoid(beta * h)
            - smoothing * torch.nn.functional.logsigmoid(-beta * h)).mean()
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


def _transformers_sft(policy_dir):
    """transformers' own labels= loss on the chosen rows, the prompt masked (-100)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    width = max(len(p) + len(c) for p, c, _, _ in PAIRS)
    ids = torch.zeros((len(PAIRS), width), dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for row, (p, c, _, _) in enumerate(PAIRS):
        ids[row, : len(p) + len(c)] = torch.tensor(p + c)
        labels[row, len(p) : len(p) + len(c)] = torch.tensor(c)
    loss = model(input_ids=ids, attention_mask=(ids != 0).long(), labels=labels).loss
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


def _assert_grads_equal(ours, theirs, case):
    assert set(ours) == {n for n, g in theirs.items() if g is not None}, case
    for name, grad in ours.items():
        scale = max(float(theirs[name].abs().max()), 1e-3)
        assert torch.allclose(grad, theirs[name], atol=1e-5 * scale, rtol=1e-4), \
            f"{case}: {name}: max difference {float((grad - theirs[name]).abs().max()):.3g} (scale {scale:.3g})"


def test_losses_and_gradients_equal_trl_and_transformers(tmp_path, workers):
    """SFT equals transformers' labels= loss with the prompt masked; the reward model's
    Bradley-Terry loss (margins, centring), accuracy, margin and gradients equal TRL's
    RewardTrainer; every DPO loss (sigmoid, conservative, IPO, with NLL, length-normalised), its
    metrics (TRL's names) and gradients equal TRL's DPOTrainer: fp32, on the same weights and pairs."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM

    from tests.helpers.hf_tokenizer import make_tokenizer_dir

    warnings.filterwarnings("ignore")
    policy = make_hf_model("llama3.1", tmp_path / "policy_hf", "lm")
    reference = copy.deepcopy(policy)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    reference.save_pretrained(tmp_path / "reference_hf")
    make_hf_model("llama3.1", tmp_path / "reward_hf", "scalar")
    for name in ("policy", "reference", "reward"):
        hf_to_megatron(str(tmp_path / f"{name}_hf"), str(tmp_path / f"{name}_mg"))
    torch.save({"pairs": PAIRS, "cases": {**{k: ours for k, (ours, _) in DPO_CASES.items()}, "rm": RM_SETTINGS}},
               tmp_path / "batch.pt")
    found = workers(1, "preference_losses", *(str(tmp_path / f"{n}_mg") for n in ("policy", "reference", "reward")),
                    str(tmp_path / "batch.pt"))[0]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path / "tokenizer")))
    loss, grads = _transformers_sft(str(tmp_path / "policy_hf"))
    assert found.losses["sft"] == pytest.approx(loss, abs=1e-5)
    _assert_grads_equal(found.grads["sft"], grads, "sft")

    loss, metrics, grads = _trl_reward(str(tmp_path / "reward_hf"), tokenizer, tmp_path / "trl_rm")
    assert found.losses["rm"] == pytest.approx(loss, abs=1e-5)
    for ours, theirs in (("accuracy", "accuracy"), ("margin", "margin")):
        assert found.metrics["rm"][ours] == pytest.approx(metrics[theirs], abs=1e-5), ours
    _assert_grads_equal(found.grads["rm"], grads, "rm")

    reference_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "reference_hf"), dtype=torch.float32)
    loss, grads = _conservative_dpo(str(tmp_path / "policy_hf"), reference_model, 0.2, 0.1)
    assert found.losses["dpo_smoothed"] == pytest.approx(loss, abs=1e-5)
    _assert_grads_equal(found.grads["dpo_smoothed"], grads, "dpo_smoothed")
    for case, (_, settings) in ((c, s) for c, s in DPO_CASES.items() if s[1] is not None):
        loss, metrics, grads = _trl_dpo(str(tmp_path / "policy_hf"), reference_model, tokenizer, settings,
                                        tmp_path / f"trl_{case}")
        assert found.losses[case] == pytest.approx(loss, abs=1e-5), case
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                     "logps/rejected"):
            assert found.metrics[case][name] == pytest.approx(metrics[name], abs=1e-5), (case, name)
        _assert_grads_equal(found.grads[case], grads, case)


STEP_FIGURES = {"rm": ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected", "reward/std"),
                "prm": ("loss", "step_accuracy", "step_score/mean"),
                "dpo": ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                        "logps/chosen", "logps/rejected")}


# Weights after four Adam steps: Adam divides each gradient by its running RMS, so a component
# whose gradient is near zero moves by up to the learning rate whatever its rounding; the steps'
# figures (losses, grad norms) and the validation on the weights hold to 1e-5.
WEIGHT_TOLERANCE = 5e-5


def _assert_same_run(run, uncut, figures, what, exact=False):
    for step, (ours, theirs) in enumerate(zip(run.steps, uncut.steps), 1):
        for name in figures:
            if step == 1 and name == "rewards/accuracies":
                continue  # DPO's first step: the policy is the reference, every reward 0 but for rounding
            assert ours[name] == pytest.approx(theirs[name], abs=1e-5), (what, step, name)
        grad_norm = next(k for k in ours if k.endswith("/grad_norm"))
        assert ours[grad_norm] == pytest.approx(theirs[grad_norm], rel=1e-5), (what, step, grad_norm)
    for name in figures:
        assert run.validation["val/" + name] == pytest.approx(uncut.validation["val/" + name], abs=1e-5), (what, name)
    assert set(run.weights) == set(uncut.weights)
    for key, tensor in run.weights.items():
        if exact:
            assert torch.equal(tensor, uncut.weights[key]), (what, key)
        else:
            assert torch.allclose(tensor, uncut.weights[key], atol=WEIGHT_TOLERANCE, rtol=0), (what, key)


def test_rm_prm_and_dpo_updates_do_not_depend_on_how_the_work_is_cut(workers):
    """Three optimizer steps of 16 pairs (the reward model; DPO with the reference scored per step,
    and with its log-probs precomputed once) or 16 stepwise rows (the process reward model) give the
    same figures, validation and weights (fp32,
    <= 1e-5) at 1 and token-packed pairs per micro-batch (a pair never split; 2 at TP=2 and PP=2),
    DP=2 and DP=1 (TP=2, PP=2), EMS on and off, and stopped after two steps and resumed by newly
    built roles (these two bit for bit)."""
    runs = workers(2, "stage_invariance")[0].runs
    for stage in ("rm", "prm", "dpo"):
        uncut = runs[f"{stage}:dp2_mb1"]
        if stage != "prm":  # three steps of new rows each: the step loss of 1-4 labelled steps a row is noisy
            assert uncut.steps[-1]["loss"] < uncut.steps[0]["loss"], f"{stage} learns"
        cuts = [name for name in runs if name.startswith(stage + ":")]
        assert len(cuts) == 6 + (stage == "dpo")
        for name in cuts:
            # EMS's round trips and a resume change nothing at all; other cuts sum in another order
            exact = name.endswith((":ems_off", ":resumed"))
            _assert_same_run(runs[name], uncut, STEP_FIGURES[stage], name, exact)


# -- Preference rows and demonstrations: the shapes read, and each bad row refused by name -----------

def _pairs(tmp_path, rows, max_length=40, chat=False, tokenizer=None):
    import json

    from megatron_rlhf.data import CharTokenizer
    from megatron_rlhf.data.preferences import PreferencePairs

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PreferencePairs(str(path), tokenizer or CharTokenizer("abcdefghijklmnopqrstuvwxyz "), max_length, chat)


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "ab ", "chosen": "cd"}, "no 'rejected' column"),
    ({"prompt": "ab ", "chosen": "cd", "rejected": "cd"}, "are the same response"),
    ({"prompt": "ab ", "chosen": "cd", "rejected": "  "}, "empty 'rejected' response"),
    ({"prompt": "ab ", "chosen": "cd", "rejected": [{"role": "assistant", "content": "x"}]}, "both be text or both"),
    ({"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "ho"}, {"role": "assistant", "content": "b"}]}, "prompts differ"),
    ({"prompt": "hi", "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "prompts differ"),
    ({"prompt": "abcdefghij", "chosen": "cd", "rejected": "ef"}, "the prompt alone is 11 tokens"),
    ({"prompt": "ab ", "chosen": "cd", "rejected": "ef", "margin": "big"}, "'margin' must be a finite number"),
    ({"prompt": "ab ", "chosen": "cd", "rejected": "ef", "margin": float("nan")}, "'margin' must be a finite number"),
    ({"chosen": "xyz", "rejected": "abc"}, "share no text"),
    ({"question": "ab ", "chosen": "ab cd", "rejected": "ab ef"}, "no 'prompt' column, but 'question' holds text"),
])
def test_a_bad_preference_row_is_refused_naming_file_and_line(tmp_path, row, problem):
    good = {"prompt": "ab ", "chosen": "cd", "rejected": "ef"}
    with pytest.raises(ValueError) as refused:
        _pairs(tmp_path, [good, row], max_length=10)
    assert "pairs.jsonl:2: " in str(refused.value) and problem in str(refused.value), str(refused.value)


def test_preference_rows_of_every_shape_are_read_and_cut_alike(tmp_path):
    """Text with a prompt; texts sharing their prompt (HH-RLHF); a chat prompt with whole
    conversations repeating it (UltraFeedback-binarized); conversations without a prompt column.
    Responses end with the end token and are the trained tokens; a pair too long keeps the first
    tokens of both responses, the prompt whole."""
    from tests.helpers.hf_tokenizer import make_tokenizer_dir

    from megatron_rlhf.data import HFTokenizer

    pairs = _pairs(tmp_path, [{"prompt": "ab ", "chosen": "cd", "rejected": "e", "margin": 1.5},
                              {"chosen": "hi yes", "rejected": "hi no"},
                              {"prompt": "ab ", "chosen": "cdefghijkl", "rejected": "mnopqrstuvw"},
                              {"chosen": "hi  yes", "rejected": "hi  yet"}], max_length=8)
    first, hh, long, one_word = pairs.pairs
    assert first.chosen.ids == [1, 3, 4, 29, 5, 6, 2] and first.chosen.trained == [0] * 4 + [1] * 3
    assert first.margin == 1.5 and first.rejected.ids[-1] == 2
    # The texts' prompt ends before the space that leads into the answers (TRL's split of HH-RLHF),
    # and never inside the word they part in.
    assert hh.chosen.prompt_length == hh.rejected.prompt_length == len("hi") + 1
    space = hh.chosen.ids[3]  # hh's response starts with the space: " yes"
    assert one_word.chosen.prompt_length == len("hi") + 1 and one_word.chosen.ids[3:6] == [space, space, 27]
    assert len(long.chosen.ids) == len(long.rejected.ids) == 8 and long.chosen.prompt_length == 4 and pairs.cut == 2
    tokenizer = HFTokenizer(str(make_tokenizer_dir(tmp_path / "tok")))
    user, answer_a, answer_b = ({"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                                {"role": "assistant", "content": "5"})
    chat = _pairs(tmp_path, [{"prompt": "2+2?", "chosen": [user, answer_a], "rejected": [user, answer_b]},
                             {"chosen": [user, answer_a], "rejected": [user, answer_b]},
                             {"prompt": [user], "chosen": [answer_a], "rejected": [answer_b]}],
                  max_length=64, chat=True, tokenizer=tokenizer)
    sides = [(p.chosen.ids, p.chosen.trained) for p in chat.pairs]
    assert sides[0] == sides[1] == sides[2]
    ids, trained = sides[0]
    assert ids[: chat.pairs[0].chosen.prompt_length] == tokenizer.encode_prompt([user], chat=True)
    assert tokenizer.decode([i for i, t in zip(ids, trained) if t]).startswith("4")
    # A multi-turn prompt (an earlier assistant turn in it) is read, not trained: only the answer is.
    earlier = [user, {"role": "assistant", "content": "7"}, {"role": "user", "content": "and 3+3?"}]
    multi = _pairs(tmp_path, [{"prompt": earlier, "chosen": [answer_a], "rejected": [answer_b]}], max_length=96,
                   chat=True, tokenizer=tokenizer).pairs[0].chosen
    assert tokenizer.decode([i for i, t in zip(multi.ids, multi.trained) if t]).startswith("4")
    assert not any(multi.trained[: multi.prompt_length]) and "7" in tokenizer.decode(multi.ids[: multi.prompt_length])


def test_a_huge_response_is_cut_before_it_is_encoded_to_the_ids_of_the_whole(tmp_path):
    """A 420 kB response: only what can fall within max_length tokens reaches the tokenizer, and the
    pair's ids are those of the whole text's encoding cut to max_length (text and chat rows)."""
    from tests.helpers.hf_tokenizer import make_tokenizer_dir

    from megatron_rlhf.data import HFTokenizer

    tokenizer = HFTokenizer(str(make_tokenizer_dir(tmp_path / "tok")))
    longest = []
    for name in ("encode_text", "encode_chat"):
        def spy(value, _real=getattr(tokenizer, name)):
            longest.append(len(value) if isinstance(value, str) else sum(len(m["content"]) for m in value))
            return _real(value)
        setattr(tokenizer, name, spy)
    huge = "the quick brown fox jumps over a lazy dog " * 10_000
    text = _pairs(tmp_path, [{"prompt": "say", "chosen": huge, "rejected": "no"}], max_length=64, tokenizer=tokenizer)
    whole = tokenizer.encode_prompt("say", chat=False) + tokenizer.encode_text(huge)
    assert text.pairs[0].chosen.ids == whole[:64] and text.pairs[0].chosen.cut and text.cut == 1
    chat = _pairs(tmp_path, [{"prompt": "say", "chosen": [{"role": "assistant", "content": huge}],
                              "rejected": [{"role": "assistant", "content": "no"}]}],
                  max_length=64, chat=True, tokenizer=tokenizer)
    whole = tokenizer.encode_chat([{"role": "user", "content": "say"}, {"role": "assistant", "content": huge}])[0]
    assert chat.pairs[0].chosen.ids == whole[:64]
    *read, text_whole, chat_whole = sorted(longest)  # the two reference encodings above are whole
    assert max(read) < 100_000 and (text_whole, chat_whole) == (len(huge), len(huge) + 3)


def test_a_bad_demonstration_is_refused_and_a_chat_trains_only_its_assistant_turns(tmp_path):
    import json

    from tests.helpers.hf_tokenizer import make_tokenizer_dir

    from megatron_rlhf.data import CharTokenizer, HFTokenizer
    from megatron_rlhf.data.demonstrations import Demonstrations

    path = tmp_path / "sft.jsonl"
    for row, problem in (({"prompt": "ab"}, "no 'completion' column"), ({"prompt": "ab", "completion": ""}, "empty"),
                         ({"messages": [{"role": "user", "content": "hi"}]}, "needs data.apply_chat_template")):
        path.write_text(json.dumps({"prompt": "ab", "completion": "cd"}) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=f"sft.jsonl:2: .*{problem}"):
            Demonstrations(str(path), CharTokenizer("abcd"), 20, chat=False)
    tokenizer = HFTokenizer(str(make_tokenizer_dir(tmp_path / "tok")))
    chat = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "and 2+2?"}, {"role": "assistant", "content": "4"}]
    path.write_text(json.dumps({"messages": chat}) + "\n")
    row = Demonstrations(str(path), tokenizer, 256, chat=True).rows[0]
    trained = tokenizer.decode([i for i, t in zip(row.ids, row.trained) if t])
    assert "2" in trained and "4" in trained and "1+1" not in trained and "2+2" not in trained


# -- Configuration and the command line --------------------------------------------------------------

PIPELINE = __import__("pathlib").Path(__file__).resolve().parent.parent / "examples" / "tiny_pipeline"


def _stage_config(tmp_path, base: str, extra: str, check_inputs: bool = True):
    from megatron_rlhf.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(f"includes: {PIPELINE / base}\n{extra}")
    return load_config(str(path), world_size=2, check_inputs=check_inputs)


@pytest.mark.parametrize("base, extra, problem", [
    ("dpo.yaml", "ppo:\n  kl_coef: 0.1\n", "ppo.kl_coef is a setting it does not read"),
    ("rm.yaml", "policy:\n  lr: 0.1\n", "policy.lr is a role it does not build"),
    ("sft.yaml", "dpo:\n  beta: 0.5\n", "dpo.beta is a setting it does not read"),
    ("sft.yaml", "data:\n  max_prompt_length: 64\n", "data.max_prompt_length is a setting it does not read"),
    ("rm.yaml", "reward:\n  global_batch_size: null\n", "reward.global_batch_size: not set"),
    ("rm.yaml", "reward:\n  global_batch_size: 15\n", "not divisible by micro_batch_size*DP"),
    ("rm.yaml", "reward:\n  lora: {rank: 2}\n  load_lora: /x\n", "reward takes none: remove it"),
    ("dpo.yaml", "reference:\n  lora: {rank: 2}\n", "reference is not trained"),
    ("dpo.yaml", "reference:\n  model: {preset: tiny, num_layers: 4}\n", "DPO's reference is the policy's network"),
    ("rm.yaml", "reward:\n  type: function\n  function: x.py:f\n", "stage rm trains a reward model"),
    ("../tiny/grpo.yaml", "dpo:\n  beta: 0.5\n", "stage rl runs"),
    ("../tiny/grpo.yaml", "data:\n  train_file: x.jsonl\n", "train_file holds the rows of the stages before RL"),
])
def test_a_stage_refuses_what_it_does_not_read_or_support_by_name(tmp_path, base, extra, problem):
    from megatron_rlhf.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        _stage_config(tmp_path, base, extra)
    assert problem in str(refused.value), str(refused.value)


def test_dpo_reference_is_the_policy_as_it_starts(tmp_path):
    from megatron_rlhf.config import ConfigError

    config = _stage_config(tmp_path, "dpo.yaml", "policy:\n  load: /some/sft/policy\n  precision: bf16\n", False)
    assert config.roles == ("policy", "reference") and config.trainable_roles == ("policy",)
    assert config.reference.load == "/some/sft/policy" and config.reference.precision == "bf16"
    assert config.reference.model == config.policy.model and config.served_weights == {}
    with pytest.raises(ConfigError) as refused:  # a missing checkpoint is named once, not again for the reference
        _stage_config(tmp_path, "dpo.yaml", "policy:\n  load: /some/sft/policy\n")
    assert str(refused.value).count("/some/sft/policy") == 1


def test_the_planner_and_dry_run_count_each_stage_s_roles(tmp_path):
    import subprocess
    import sys

    from megatron_rlhf.memory.planner import plan

    dpo = _stage_config(tmp_path, "dpo.yaml", "")
    planned = plan(dpo, 2)
    assert list(planned.phases) == ["reference", "train_policy"] and set(planned.roles) == {"policy", "reference"}
    assert "optimizer_state" not in planned.resident["reference"]["reference"]
    assert set(plan(_stage_config(tmp_path, "rm.yaml", ""), 2).roles) == {"reward"}
    out = subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--config", str(PIPELINE / "dpo.yaml"), "--dry-run",
                          "--world-size", "2"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "reference" in out.stdout and "train_policy" in out.stdout and "ppo_policy" not in out.stdout


def test_a_bad_row_stops_the_launch_with_one_error_line(tmp_path):
    import json
    import subprocess
    import sys

    bad = tmp_path / "pairs.jsonl"
    bad.write_text(json.dumps({"prompt": "ab ", "chosen": "cd", "rejected": "ef"}) + "\n"
                   + json.dumps({"prompt": "ab ", "chosen": "cd", "rejected": "cd"}) + "\n")
    out = subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--config", str(PIPELINE / "rm.yaml"),
                          "--check-only", "--world-size", "2"], capture_output=True, text=True, cwd=tmp_path,
                         env={**__import__("os").environ, "TRAIN_FILE": str(bad)})
    assert out.returncode == 2 and out.stderr.count("error:") == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{bad}:2: 'chosen' and 'rejected' are the same response" in out.stderr


def _launch(config, output_dir, *flags, **environment):
    from tests.test_train import train

    return train(output_dir, *flags, config=config, env={"PROGRESS_BAR": "False", "TENSORBOARD": "False", **environment},
                 timeout=300).stdout


def _latest(output_dir, role):
    return output_dir / "checkpoints" / (output_dir / "checkpoints" / "latest").read_text() / role


def test_stage_checkpoints_go_into_ppo_as_written_and_the_reward_model_exports_to_transformers(tmp_path):
    """A reward model trained by stage rm is PPO's reward.load as written (its held-out scores'
    mean and std recorded for reward.normalize; stopped after two steps and resumed to four, then
    refused as having nothing left to do), and an SFT policy PPO's policy, reference and
    ppo_policy load, nothing converted; the reward model exported to Hugging Face
    (XForSequenceClassification, one label) scores the held-out pairs as our validation did (<= 1e-4);
    one without statistics is refused for reward.normalize before start-up."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoModelForSequenceClassification

    from megatron_rlhf.checkpoint.convert import megatron_to_hf

    _launch(PIPELINE / "rm.yaml", tmp_path / "rm", "--iterations", "2")
    resumed = _launch(PIPELINE / "rm.yaml", tmp_path / "rm", "--iterations", "4", "--resume")
    assert "resumed from" in resumed and "(step 2," in resumed
    steps = [json.loads(line)["iteration"] for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    nothing = subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--config", str(PIPELINE / "rm.yaml"), "--output-dir",
                              str(tmp_path / "rm"), "--iterations", "4", "--resume", "--check-only"],
                             capture_output=True, text=True)
    assert nothing.returncode == 2 and "is at step 4 and the run has 4 steps" in nothing.stderr, nothing.stderr
    _launch(PIPELINE / "sft.yaml", tmp_path / "sft", "--iterations", "2")
    reward, policy = _latest(tmp_path / "rm", "reward"), _latest(tmp_path / "sft", "policy")
    _launch(PIPELINE / "ppo.yaml", tmp_path / "ppo", "--iterations", "2", POLICY_LOAD=str(policy),
            REWARD_LOAD=str(reward), PROMPT_FILE=str(PIPELINE / "prompts.jsonl"))
    metrics = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["reward/mean"] != 0 for m in metrics)
    # The reward model's files record its last validation's scores, which PPO's reward.normalize read.
    last = json.loads((tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()[-1])
    scores = json.loads((reward / "megatron_rlhf_model.json").read_text())["scores"]
    assert scores["mean"] == pytest.approx(last["val/reward/mean"]) and scores["std"] == pytest.approx(last["val/reward/std"])

    # Exported to Hugging Face, transformers scores the held-out pairs as our validation did: the
    # mean and std over every side (256 sequences, scored by us at DP=2) the checkpoint recorded.
    from megatron_rlhf.data import CharTokenizer
    from megatron_rlhf.data.preferences import PreferencePairs

    megatron_to_hf(str(reward), str(tmp_path / "reward_hf"))
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "reward_hf"), dtype=torch.float32)
    assert hf.config.num_labels == 1
    pairs = PreferencePairs(str(PIPELINE / "pairs_val.jsonl"), CharTokenizer("abcdefghijklmnopqrstuvwxyz "), 40, False)
    with torch.no_grad():  # a sequence at a time: unpadded, transformers scores its last token, as PPO's reward does
        theirs = torch.cat([hf(input_ids=torch.tensor([side.ids])).logits[:, 0] for p in pairs.pairs
                            for side in (p.chosen, p.rejected)])
    assert len(theirs) == 256 and float(theirs.mean()) == pytest.approx(scores["mean"], abs=1e-4)
    assert float(theirs.std()) == pytest.approx(scores["std"], abs=1e-4)

    # A reward model that records no statistics (converted from elsewhere) is refused for reward.normalize.
    from megatron_rlhf.checkpoint.convert import hf_to_megatron

    hf_to_megatron(str(tmp_path / "reward_hf"), str(tmp_path / "reward_converted"))
    refused = subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--config", str(PIPELINE / "ppo.yaml"),
                              "--check-only", "--world-size", "2"], capture_output=True, text=True, cwd=tmp_path,
                             env={**os.environ, "POLICY_LOAD": str(policy), "REWARD_LOAD": str(tmp_path / "reward_converted"),
                                  "PROMPT_FILE": str(PIPELINE / "prompts.jsonl")})
    assert refused.returncode == 2 and "reward.normalize" in refused.stderr and "records no score statistics" in \
        refused.stderr and "Traceback" not in refused.stderr, refused.stderr

    # The trained models record the tokenizer they read; one of the same size that spells its ids
    # otherwise (the alphabet in another order) is refused before start-up.
    assert json.loads((reward / "megatron_rlhf_model.json").read_text())["tokenizer"]["source"] == \
        "char:abcdefghijklmnopqrstuvwxyz "
    other = subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--config", str(PIPELINE / "ppo.yaml"),
                            "--check-only", "--world-size", "2", "data.tokenizer.alphabet=bacdefghijklmnopqrstuvwx yz"],
                           capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "POLICY_LOAD": str(policy), "REWARD_LOAD": str(reward),
                                "PROMPT_FILE": str(PIPELINE / "prompts.jsonl")})
    assert other.returncode == 2 and other.stderr.count("error:") == 1 and "was trained with the tokenizer char:" \
        in other.stderr and "the model would read its ids as other text" in other.stderr, other.stderr


def test_lora_dpo_trains_the_adapters_alone_against_the_base_as_reference(tmp_path):
    """DPO with LoRA on the policy: the reference is the base (it shares the policy's frozen base
    weights, verl's ref_in_actor, as in RL), so the first step's rewards are 0 (the adapters start as
    zero); the checkpoint holds the adapters beside the base and exports as a PEFT adapter. SFT and
    the reward model take adapters on their trained role the same way (config)."""
    import json

    from megatron_rlhf.checkpoint.peft import write_peft_adapter

    config = _stage_config(tmp_path, "dpo.yaml", "policy:\n  lora: {rank: 4, alpha: 8}\n")
    assert config.served_weights == {"reference": "policy"} and config.weight_owner("reference") == "policy"
    assert config.lora_of("policy").rank == 4 and not config.lora_of("reference").enabled
    rm = _stage_config(tmp_path, "rm.yaml", "reward:\n  lora: {rank: 2}\n")
    assert rm.lora_of("reward").rank == 2 and rm.served_weights == {}
    (tmp_path / "lora.yaml").write_text(f"includes: {PIPELINE / 'dpo.yaml'}\npolicy:\n  lora: {{rank: 4, alpha: 8}}\n"
                                        "  lr: 1.0e-2\n")
    _launch(tmp_path / "lora.yaml", tmp_path / "dpo", "--iterations", "3", VAL_INTERVAL="0", VAL_FILE="")
    steps = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert abs(steps[0]["rewards/chosen"]) < 1e-5 and abs(steps[0]["rewards/rejected"]) < 1e-5
    assert abs(steps[-1]["rewards/margins"]) > 1e-4, "the adapters moved the policy away from the base"
    policy = _latest(tmp_path / "dpo", "policy")
    assert json.loads((policy / "megatron_rlhf_model.json").read_text())["lora"]["rank"] == 4
    write_peft_adapter(str(policy), str(tmp_path / "peft"))
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["r"] == 4
