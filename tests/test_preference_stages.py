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


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_rm_and_dpo_updates_do_not_depend_on_how_the_work_is_cut(workers, stage):
    """Four optimizer steps of 16 pairs (the reward model; DPO with the reference scored per step,
    and with its log-probs precomputed once, IPO) give the same figures, validation and weights
    (fp32, <= 1e-5) at 1, 4 and token-packed pairs per micro-batch (a pair never split), DP=2 and
    DP=1 (TP=2, PP=2), EMS on and off, and stopped after two steps and resumed by newly built roles
    (these two bit for bit)."""
    cases = [()] if stage == "rm" else [(), ("REFERENCE_LOGPS=precompute", "CUTS=dp2_mb1")]
    runs = {}
    for settings in cases:
        found = workers(2, "stage_invariance", stage, *settings)[0].runs
        runs.update({f"{name}{'+' + settings[0] if settings else ''}": run for name, run in found.items()})
    uncut = runs["dp2_mb1"]
    assert uncut.steps[-1]["loss"] < uncut.steps[0]["loss"], "the stage learns"
    for name, run in runs.items():
        # EMS's round trips and a resume change nothing at all; other cuts sum in another order
        exact = name in ("ems_off", "resumed")
        _assert_same_run(run, uncut, STEP_FIGURES[stage], name, exact)
