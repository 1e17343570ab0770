"""Rewards from models that read. The LLM judge (the judge section, rollout/judging.py): its verdicts
read by each parser and combined by each rule, its settings refused by name, and GRPO scored by it
alone: the same numbers with EMS on and off and with the judge at a layout of its own, only the judge
on the device in its phase, that phase's memory as the planner plans it. A process reward model in
RL (reward.step_separator): its steps found, aggregated by each rule, and as token rewards."""

import re

import pytest
import torch

from megatron_rlhf.config import ConfigError, load_config
from megatron_rlhf.rewards.verdicts import boxed_parser, choice_parser, combined, fill_template, number_parser
from tests.conftest import REPO

GRPO = REPO / "examples/tiny_judge/grpo.yaml"


# -- verdicts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("verdict, score", [
    ("7", 7.0), (" 8/10, fine", 8.0), ("score: 2.5 of 9", 2.5), ("-1", None), ("12", None), ("none", None), ("", None),
])
def test_the_number_parser_reads_the_first_number_within_the_range(verdict, score):
    assert number_parser(0, 10)(verdict) == score


@pytest.mark.parametrize("verdict, score", [
    ("so \\boxed{3} then \\boxed{6}", 6.0), ("\\boxed{\\frac{1}{2}} no", 1.0), ("6 but no box", None),
    ("\\boxed{11}", None), ("\\boxed{ 4 }.", 4.0),
])
def test_the_boxed_parser_reads_the_last_box(verdict, score):
    assert boxed_parser(0, 10)(verdict) == score


@pytest.mark.parametrize("verdict, score", [
    ("A", 1.0), ("B.", 0.0), ("I pick B over A", 0.0), ("Alice wins", None), ("AB", 0.5), ("tie: AB", 0.5), ("", None),
])
def test_the_choice_parser_takes_the_first_choice_said_as_a_word(verdict, score):
    assert choice_parser({"A": 1.0, "B": 0.0, "AB": 0.5})(verdict) == score


def test_verdicts_combine_by_each_rule_with_the_unparsed_at_their_default():
    scores = [1.0, None, 4.0, 4.0, 2.0, 2.0, None, None]  # four responses, two verdicts each
    assert combined(scores, 2, "mean", -1.0) == [0.0, 4.0, 2.0, -1.0]
    assert combined(scores, 2, "min", 0.5) == [0.5, 4.0, 2.0, 0.5]
    assert combined(scores, 2, "max", 0.5) == [1.0, 4.0, 2.0, 0.5]
    assert combined([3.0, 1.0, 3.0, 1.0], 4, "majority", 0.0) == [1.0]  # a tie goes to the lower
    assert combined([3.0, 1.0, 3.0, None], 4, "majority", 0.0) == [3.0]


def test_chat_messages_are_filled_each_and_go_through_the_chat_template(tmp_path):
    from megatron_rlhf.data.tokenizer import HFTokenizer
    from megatron_rlhf.rollout.judging import judge_prompt
    from tests.helpers.hf_tokenizer import make_tokenizer_dir

    messages = [{"role": "system", "content": "rate 1-2"}, {"role": "user", "content": "{prompt} {response}"}]
    filled = judge_prompt(messages, "2+2", "4", "")
    assert filled == [messages[0], {"role": "user", "content": "2+2 4"}] and messages[1]["content"].endswith("}")
    tokenizer = HFTokenizer(str(make_tokenizer_dir(tmp_path / "tokenizer")))
    rendered = tokenizer.decode(tokenizer.encode_prompt(filled, chat=True))
    assert rendered.startswith("system\nrate 1-2") and "user\n2+2 4" in rendered, rendered


def test_the_template_fills_its_fields_once_and_keeps_other_braces():
    text = fill_template("Q: {prompt} A: {response} ref {reference} {x} {{prompt}}", "p {response}", "r {prompt}", "t")
    assert text == "Q: p {response} A: r {prompt} ref t {x} {p {response}}"


# -- settings --------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, problem", [
    (["judge.enabled=false"], "judge.template_file: set, but judge.enabled is false"),
    (["judge.template=rate it"], "give the judge's prompt as judge.template"),
    (["judge.template_file=null", "judge.template=rate {prompt}"], "never shows the response"),
    (["judge.template_file=missing.txt"], "missing.txt: no such file"),
    (["judge.parser=choice"], "judge.score_range: set, but judge.parser is choice"),
    (["judge.choices={A: 1.0}"], "judge.choices: set, but judge.parser is number"),
    (["judge.combine=max"], "judge.combine: set, but judge.samples is 1"),
    (["judge.score_range=[9, 0]"], "must be [low, high] with low < high"),
    (["judge.parser=function"], "judge.parser is function: name it as 'module:callable'"),
    (["judge.messages=[{role: user, content: '{response}'}]"], "given: template_file, messages"),
    (["judge.template_file=null", "judge.messages=[{role: user, content: '{response}'}]"],
     "chat messages go through the tokenizer's chat template"),
    (["judge.parser_function=x:y"], "judge.parser_function: set, but judge.parser is number"),
])
def test_judge_settings_that_cannot_work_are_refused_by_name(monkeypatch, overrides, problem):
    monkeypatch.setenv("JUDGE_LOAD", str(REPO / "examples"))
    with pytest.raises(ConfigError) as raised:
        load_config(str(GRPO), world_size=2, overrides=overrides, check_inputs=True)
    assert problem in str(raised.value), str(raised.value)


def test_no_reward_and_no_judge_is_refused(tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text(f"includes: {REPO}/examples/tiny/grpo.yaml\nreward:\n  type: judge\n  function: null\n")
    with pytest.raises(ConfigError, match="reward.type: judge, but judge.enabled is false: nothing scores"):
        load_config(str(config), world_size=2, check_inputs=False)


def test_a_judge_is_refused_where_the_stage_does_not_build_one(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text(f"includes: {REPO}/examples/tiny_judge/judge_sft.yaml\njudge:\n  enabled: true\n")
    with pytest.raises(ConfigError, match="stage sft runs policy; judge.enabled is a role it does not build"):
        load_config(str(config), world_size=2, check_inputs=False)


# -- GRPO scored by the judge ----------------------------------------------------------------------

LEDGER_KINDS = ("weights", "grads", "main_params", "optimizer_state", "kv_cache", "reshard_buffers")


def _phase_peaks(records):
    """active role -> (the moment of its phase with the most device bytes, those bytes by role and kind)."""
    moments = {}
    for r in records:
        moments.setdefault(r["moment"], []).append(r)
    peaks = {}
    for rows in moments.values():
        active = rows[0]["active_role"]
        held = {r["role"]: {k: r["bytes"][k] for k in LEDGER_KINDS if r["bytes"][k]} for r in rows}
        total = sum(sum(kinds.values()) for kinds in held.values())
        if active is not None and total >= peaks.get(active, (-1, None))[0]:
            peaks[active] = (total, {role: kinds for role, kinds in held.items() if kinds})
    return peaks


def _check_process_reward(found):
    """A REINFORCE++ iteration scored by a process reward model with token rewards: each response's
    steps end at each "a" and at its end, a reward in (0, 1) at the action that wrote each end and
    nowhere else, summing to the response's score."""
    a = 3 + "abcdefghijklmnopqrstuvwxyz ".index("a")  # the char tokenizer's id of "a"
    for row, (n, m) in enumerate(zip(found["prompt_lengths"].tolist(), found["response_lengths"].tolist())):
        response = found["tokens"][row, n : n + m].tolist()
        ends = {n + i for i, t in enumerate(response) if t == a} | ({n + m - 1} if m else set())
        rewards = found["step_rewards"][row]
        assert set((rewards != 0).nonzero().flatten().add(1).tolist()) == ends
        assert all(0 < float(rewards[e - 1]) < 1 for e in ends)
        assert float(rewards.sum()) == pytest.approx(float(found["scores"][row]), abs=1e-6)
    assert found["metrics"]["reward/steps"] > 1 and found["metrics"]["loss/policy"] != 0


def test_grpo_scored_by_a_judge_does_not_depend_on_ems_or_the_judge_layout(tmp_path, workers, monkeypatch):
    """Two GRPO iterations scored by a random judge alone (two sampled verdicts per response, read as
    numbers): every metric and score equal bit for bit with EMS on and off, and to 1e-5 with the judge
    at TP=2 (the run at TP=1, DP=2); in the judge's phase only the judge is on the device, and every
    phase's state and KV cache are what the planner plans (so the run's peak is its largest phase's,
    the judge's included); a judge prompt over judge.max_prompt_length is counted and not judged; a
    parser function in the reward pool's workers scores as the number parser it mirrors. In the same
    launch, a process reward model's token rewards (_check_process_reward)."""
    from megatron_rlhf.checkpoint.convert import hf_to_megatron
    from tests.helpers.hf_families import make_hf_model

    make_hf_model("llama3.1", tmp_path / "judge_hf", "lm")
    hf_to_megatron(str(tmp_path / "judge_hf"), str(tmp_path / "judge"))
    found = workers(2, "judge_runs", str(tmp_path / "judge"))[0]
    on = found.metrics["ems_on"]
    assert found.scores["ems_on"].std() > 0 and 0 < on[0]["judge/unparsed"] < 32, "the verdicts tell responses apart"
    assert on[1]["loss/policy"] != 0
    assert found.metrics["ems_off"] == on and torch.equal(found.scores["ems_off"], found.scores["ems_on"])
    assert torch.equal(found.scores["judge_tp2"], found.scores["ems_on"])
    by_function, by_parser = found.metrics["parser_function"][0], found.metrics["parser_number"][0]
    assert by_function.pop("judge/failures") == 0 and by_function.pop("judge/timeouts") == 0
    assert by_function == by_parser and by_parser["judge/unparsed"] < 32 and by_parser["reward/std"] > 0
    assert torch.equal(found.scores["parser_function"], found.scores["parser_number"])
    short = found.metrics["short_prompts"][-1]  # judge prompts over 20 tokens are not judged: scored 0, counted
    assert short["judge/too_long"] > 0
    assert int((found.scores["short_prompts"] == 0).sum()) >= short["judge/too_long"]
    for ours, theirs in zip(found.metrics["judge_tp2"], on):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert ours[key] == pytest.approx(value, abs=1e-5), key

    _check_process_reward(found.process_reward)
    peaks = _phase_peaks(found.records)
    assert set(peaks["judge"][1]) == {"judge"}, "only the judge on the device in its phase"
    assert peaks["judge"][1]["judge"]["kv_cache"] > 0
    monkeypatch.setenv("JUDGE_LOAD", str(tmp_path / "judge"))
    phases = dict(load_config(str(GRPO), world_size=2, check_inputs=False).phase_order)
    for phase, planned in found.planned.items():
        if phase not in phases:
            continue
        recorded = peaks[phases[phase]][1]
        expected = {role: {k: v for k, v in kinds.items() if k in LEDGER_KINDS and v} for role, kinds in planned.items()}
        assert recorded == {role: kinds for role, kinds in expected.items() if kinds}, phase


@pytest.mark.parametrize("template, problem", [
    ("rate: {response}", "judge.template_file: the run's tokenizer cannot encode it: character ':' is not in"),
    ("rate {prompt}", "judge.template_file: the judge's template never shows the response"),
])
def test_a_template_file_is_checked_at_start_up(tmp_path, monkeypatch, template, problem):
    from megatron_rlhf.data import CharTokenizer
    from megatron_rlhf.startup import _check_judge

    (tmp_path / "template.txt").write_text(template)
    monkeypatch.setenv("JUDGE_LOAD", str(tmp_path))
    config = load_config(str(GRPO), world_size=2, check_inputs=False,
                         overrides=[f"judge.template_file={tmp_path / 'template.txt'}"])
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(")):
        _check_judge(config, CharTokenizer(config.data.tokenizer.alphabet))


# -- a process reward model in RL ------------------------------------------------------------------

def test_step_ends_are_found_left_to_right_and_at_the_response_end():
    from megatron_rlhf.rollout.scoring import step_ends

    tokens = torch.tensor([[1, 5, 6, 9, 9, 7, 9, 9, 8, 0, 0], [1, 5, 9, 9, 9, 9, 0, 0, 0, 0, 0], [1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    ends = step_ends(tokens, torch.tensor([2, 2, 1]), torch.tensor([7, 4, 0]), [9, 9])
    assert ends.nonzero().tolist() == [[0, 4], [0, 7], [0, 8], [1, 3], [1, 5]]  # "9 9 9 9" is two separators


def test_step_scores_aggregate_by_each_rule():
    from megatron_rlhf import ppo

    scores = torch.tensor([[0.0, 0.9, 0.2, 0.7, 0.0], [0.5, 0.6, 0.0, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0, 0.0]])
    ends = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    expected = {"min": [0.2, 0.5, 0.0], "last": [0.7, 0.6, 0.0], "mean": [0.6, 0.55, 0.0], "token": [1.8, 1.1, 0.0]}
    for rule, values in expected.items():
        assert ppo.STEP_AGGREGATIONS[rule](scores, ends).tolist() == pytest.approx(values), rule
    mask = torch.ones(1, 4)
    rewards = ppo.token_rewards(torch.tensor([1.8]), torch.full((1, 4), 0.5), 0.1, mask, torch.tensor([[0.9, 0.0, 0.2, 0.7]]))
    assert rewards[0].tolist() == pytest.approx([0.85, -0.05, 0.15, 0.65])  # each step's score where it ends, no outcome


def test_the_dry_run_plans_the_judge_and_says_how_each_model_reward_reads(monkeypatch, capsys):
    """The judge's phase with its KV cache in the plan, its verdicts and parser said; a process reward
    model's steps and aggregation said."""
    from megatron_rlhf.dry_run import dry_run

    monkeypatch.setenv("JUDGE_LOAD", str(REPO / "examples"))
    assert dry_run(str(GRPO), world_size=2, overrides=["judge.model.preset=tiny"]) == 0
    out = capsys.readouterr().out
    assert "judge      1 greedy verdict per response, up to 2 tokens after a prompt of up to 48; parser number " \
           "(in [0, 9]), unparsed 0; 0.111111 x its score added to the reward" in out
    header = next(line for line in out.splitlines() if line.startswith("role ") and "kv_cache" in line).split()
    row = next(line for line in out.splitlines() if line.startswith("judge ") and line.endswith(" B"))
    figures = dict(zip(header[1:], re.findall(r"\d[\d.]* [KMG]?i?B", row)))
    assert figures["kv_cache"] != "0 B" and figures["decode_step"] != "0 B", row
    phases = [line.split()[0] for line in out.split("phase          resident on the device")[1].splitlines()[1:5]]
    assert phases == ["generate", "judge", "reference", "train_policy"]
    assert dry_run(str(REPO / "examples/tiny/grpo.yaml"), world_size=2, overrides=[
        "reward.type=model", "reward.function=null", "reward.step_separator=a", "reward.step_aggregation=last"]) == 0
    assert "reward     process reward model: steps end at 'a' and at the response's end, each scored sigmoid(its " \
           "last token's score); the last of the step scores" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, problem", [
    (["reward.step_aggregation=min"], "reward.step_aggregation: set, but reward.step_separator is not"),
    (["reward.step_aggregation=token"], "grpo reads one outcome per response"),
    (["reward.type=function"], "reward.step_separator: a process reward model's steps, but reward.type is function"),
    (["reward.normalize=true"], "step scores are probabilities"),
])
def test_process_reward_settings_that_cannot_work_are_refused(overrides, problem):
    base = ["reward.type=model", "reward.function=null"] + ([] if "separator is not" in problem else
                                                             ["reward.step_separator=a"])
    with pytest.raises(ConfigError, match=problem):
        load_config(str(REPO / "examples/tiny/grpo.yaml"), world_size=2, check_inputs=False, overrides=base + overrides)
