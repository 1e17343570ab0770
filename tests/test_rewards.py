"""Rule rewards: the built-in verifiers against hand-made cases, the contract (fields as keyword
arguments, named sub-scores, weights), and the worker pool's faults: a call that raises or hangs
scores reward.failure_score and is counted; a breach of the contract, an exit from the worker or a
batch where every call failed ends the run with a line naming the function."""

import json
import os
import time
from contextlib import closing
from pathlib import Path

import pytest

from megatron_rlhf.errors import RewardFunctionError
from megatron_rlhf.rewards.contract import load_reward_function
from megatron_rlhf.rewards.pool import RewardPool
from megatron_rlhf.rewards.verifiers import answer_format, gsm8k, math

RULES = '''
import os, sys, time

def exact(prompts, responses, ground_truth):
    return [float(r.strip() == t) for r, t in zip(responses, ground_truth)]

def parts(prompts, responses, **fields):
    return {"score": [len(r) for r in responses], "source_is_a": [float(f == "a") for f in fields["data_source"]]}

def picky(prompts, responses):
    return [1.0 / (len(r) - 2) for r in responses]

def always_raises(prompts, responses):
    raise KeyError("boom")

def sleeps_on_x(prompts, responses):
    if responses[0] == "x":
        time.sleep(1e6)
    return [1.0]

def strings(prompts, responses):
    return ["0.5" for r in responses]

def scalar(prompts, responses):
    return 0.5

def exits(prompts, responses):
    sys.exit(3)

def dies(prompts, responses):
    print("about to die")
    os._exit(7)

def trl_style(completions, ground_truth, **kwargs):  # TRL's convention: every argument by keyword
    assert kwargs["prompts"] == ["p"] * len(completions) or kwargs["prompts"] == ["q"]
    return [float(c == t) + 0.25 * (kwargs["data_source"][i] == "a") for i, (c, t) in enumerate(zip(completions, ground_truth))]

def trl_prompts(prompts, completions):
    return [float(len(p) + len(c)) for p, c in zip(prompts, completions)]

def trl_needs_ids(completions, completion_ids):
    return [0.0 for c in completions]

def only_digits(completions, **kwargs):  # TRL: None where the function does not apply
    return [float(c == "7") if c.isdigit() else None for c in completions]

def as_tensors(completions, **kwargs):  # numbers as 0-d tensors and numpy scalars
    import numpy, torch
    return [torch.tensor(0.5) if c == "7" else numpy.float32(0.25) for c in completions]

async def awaited(completions, **kwargs):  # TRL awaits async reward functions
    import asyncio
    await asyncio.sleep(0)
    return [1.0 for c in completions]

def one_tensor(completions, **kwargs):
    import torch
    return torch.tensor(0.5)
'''


@pytest.fixture
def rules(tmp_path):
    (tmp_path / "rules.py").write_text(RULES)
    return lambda name: f"{tmp_path}/rules.py:{name}"


def test_gsm8k_and_format_read_the_final_answer():
    responses = ["so 3 + 4 = 7\n#### 7", "#### 1,234.", "the answer is 7", "#### 6\n#### 7", "#### $12"]
    assert gsm8k([""] * 5, responses, ["7", "1234", "7", "7", "12"]) == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert gsm8k([""], ["#### 8"], ["7"]) == [0.0]
    # A list of answers: any of them is right.
    assert gsm8k(["", ""], ["#### 12", "#### 13"], [["12"], ["12", "14"]]) == [1.0, 0.0]
    assert answer_format([""] * 3, ["#### 3", r"\boxed{3}", "three"]) == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("response,truth,right", [
    (r"so \boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{2/4}", r"\frac{1}{2}", True),  # equivalent fractions
    (r"\boxed{x^2 + 2x + 1}", "(x+1)^2", True),  # equivalent expressions
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}", True),
    (r"\boxed{3}", "4", False),  # wrong
    (r"\boxed{\frac{1}{3}}", "0.5", False),
    ("I do not know", "4", False),  # no answer
    (r"\boxed{12}", ["12", "13"], True),  # a list: any of its answers
    (r"\boxed{14}", ["12", "13"], False),
])
def test_the_math_verifier_on_hand_made_cases(response, truth, right):
    assert math([""], [response], [truth]) == [float(right)]


def test_fields_sub_scores_and_weights(rules):
    with closing(RewardPool({rules("exact"): 1.0, rules("parts"): 0.5}, num_workers=2)) as pool:
        scores, metrics = pool.score(["p", "q"], ["7", "8"], [{"ground_truth": "7", "data_source": "a"},
                                                            {"ground_truth": "7", "data_source": "b"}])
    assert scores.tolist() == [1.0 + 0.5 * 1, 0.0 + 0.5 * 1]
    assert metrics["reward/exact"] == 0.5 and metrics["reward/parts"] == 1.0 and metrics["reward/parts/source_is_a"] == 0.5
    assert metrics["reward/failures"] == 0 and metrics["reward/timeouts"] == 0


def test_a_trl_style_function_is_called_by_keyword_as_trl_calls_it(rules, tmp_path):
    """A function whose signature names ``completions`` gets every argument by keyword, as TRL's
    trainers pass them (prompts, completions, the row's columns); one that requires what no trainer
    here passes (TRL's completion_ids) is refused at start-up by name."""
    with closing(RewardPool({rules("trl_style"): 1.0, rules("trl_prompts"): 1.0}, num_workers=1)) as pool:
        scores, metrics = pool.score(["p", "q"], ["7", "8"], [{"ground_truth": "7", "data_source": "a"},
                                                            {"ground_truth": "7", "data_source": "b"}])
    assert metrics["reward/failures"] == 0
    assert metrics["reward/trl_style"] == pytest.approx((1.25 + 0.0) / 2) and metrics["reward/trl_prompts"] == 2.0
    assert scores.tolist() == [1.25 + 2.0, 0.0 + 2.0]
    from megatron_rlhf.config import ConfigError
    from megatron_rlhf.startup import prepare
    from megatron_rlhf.train import parse_args

    config = tmp_path / "trl.yaml"
    config.write_text(f"includes: {Path(__file__).parent.parent / 'examples' / 'tiny' / 'rlhf.yaml'}\n"
                      f"reward:\n  function: {rules('trl_needs_ids')}\n")
    with pytest.raises(ConfigError, match=r"trl_needs_ids takes TRL's arguments and requires completion_ids, which no "
                                          r"trainer here passes; it is given prompts and completions and the row's "
                                          r"columns by keyword"):
        prepare(parse_args(["--config", str(config), "--output-dir", str(tmp_path / "out"), "--check-only"]), 2)


def test_trl_s_contract_none_where_a_function_does_not_apply_tensors_and_async_functions(rules):
    """As TRL takes them: None adds nothing to the reward (a response no function applies to scores
    0, TRL's nansum; counted), 0-d tensors and numpy scalars are numbers, an async function is awaited.
    A whole 0-d tensor is one number for a list of them, said so (once a TypeError of ours)."""
    rows = [{}, {}, {}]
    with closing(RewardPool({rules("only_digits"): 1.0, rules("as_tensors"): 2.0, rules("awaited"): 0.5},
                            num_workers=1)) as pool:
        scores, metrics = pool.score(["p"] * 3, ["7", "x", "8"], rows)
    assert scores.tolist() == [1.0 + 2 * 0.5 + 0.5, 2 * 0.25 + 0.5, 0.0 + 2 * 0.25 + 0.5]
    assert metrics["reward/not_applicable"] == 1 and metrics["reward/only_digits"] == 0.5  # over the two it applies to
    with closing(RewardPool({rules("only_digits"): 1.0}, num_workers=1)) as pool:
        assert pool.score(["p"], ["x"], [{}])[0].tolist() == [0.0]
    with closing(RewardPool({rules("one_tensor"): 1.0}, num_workers=1)) as pool:
        with pytest.raises(RewardFunctionError, match=r"rules.py:one_tensor returned Tensor tensor\(0.5000\); expected a "
                                                      r"list of 1 numbers"):
            pool.score(["p"], ["x"], [{}])


def test_a_call_that_raises_or_hangs_scores_the_failure_score_and_is_counted(rules):
    with closing(RewardPool({rules("picky"): 1.0}, num_workers=2, failure_score=-1.0)) as pool:
        with pytest.warns(UserWarning, match=r"1 of 3 reward calls failed \(0 timed out\) and scored "
                                             r"reward.failure_score=-1; the first: reward function .*picky raised"):
            scores, metrics = pool.score(["p0", "p1", "p2"], ["abc", "ab", "abcd"], [{}, {}, {}])
    assert scores.tolist() == [1.0, -1.0, 0.5] and metrics["reward/failures"] == 1
    # With several functions, each one's score (failures at failure_score) and failures are reported,
    # also when every call of one of them failed.
    with closing(RewardPool({rules("picky"): 1.0, rules("always_raises"): 0.5}, num_workers=1, failure_score=0.0)) as pool:
        with pytest.warns(UserWarning, match="4 of 6 reward calls failed"):
            _, metrics = pool.score(["p0", "p1", "p2"], ["abc", "ab", "abcd"], [{}, {}, {}])
    assert metrics["reward/picky/failures"] == 1 and metrics["reward/always_raises/failures"] == 3
    assert metrics["reward/always_raises"] == 0.0 and metrics["reward/picky"] == pytest.approx(1.5 / 3)
    with closing(RewardPool({rules("sleeps_on_x"): 1.0}, num_workers=1, timeout_s=2.0, failure_score=-1.0)) as pool:
        started = time.monotonic()
        scores, metrics = pool.score(["p"] * 3, ["a", "x", "b"], [{}] * 3)
        assert time.monotonic() - started < 2.0 + 5.0
        assert scores.tolist() == [1.0, -1.0, 1.0] and metrics["reward/timeouts"] == 1  # the worker was replaced
        # A worker takes its calls in batches (6 of these 24): a call that hangs in the middle of one
        # times out alone, and the rest of its batch is scored by the fresh worker.
        responses = ["a"] * 24
        responses[2] = "x"
        started = time.monotonic()
        scores, metrics = pool.score(["p"] * 24, responses, [{}] * 24)
        assert time.monotonic() - started < 2.0 + 5.0
        assert scores.tolist() == [1.0] * 2 + [-1.0] + [1.0] * 21 and metrics["reward/timeouts"] == 1


def test_a_reward_that_blocks_on_every_call_ends_the_batch_after_two_time_outs_per_worker(rules):
    with closing(RewardPool({rules("sleeps_on_x"): 1.0}, num_workers=2, timeout_s=1.0)) as pool:
        started = time.monotonic()
        with pytest.raises(RewardFunctionError, match=r"the first 4 reward calls of the batch all timed out \(nothing "
                                                      r"answered\); the first: reward function .*rules.py:sleeps_on_x took "
                                                      r"over 1s \(reward.timeout_s\)"):
            pool.score(["p"] * 16, ["x"] * 16, [{}] * 16)
        assert time.monotonic() - started < 2 * 1.0 + 8.0  # not 16 time-outs: 2 rounds of the 2 workers


@pytest.mark.parametrize("name,message", [
    ("strings", r"rules.py:strings returned str '0.5'; expected a list of 1 numbers.* on response 0 \(prompt 'p0'\)"),
    ("scalar", r"rules.py:scalar returned float 0.5; expected a list of 1 numbers"),
    ("exits", r"rules.py:exits called sys.exit\(3\); a reward must return its scores, not exit on response 0"),
    ("dies", r"rules.py:dies ended its worker process \(exit code 7\) on response 0 \(prompt 'p0'\)"),
    ("always_raises", r"every reward call of the batch failed; the first: reward function .*rules.py:always_raises "
                      r"raised KeyError: 'boom' at .*rules.py:\d+ .* on response 0"),
])
def test_a_broken_function_ends_the_run_naming_it(rules, name, message):
    with closing(RewardPool({rules(name): 1.0}, num_workers=1)) as pool:
        with pytest.raises(RewardFunctionError, match=message):
            pool.score(["p0", "p1"], ["abc", "ab"], [{}, {}])


def test_loading_errors_name_the_spec(tmp_path):
    (tmp_path / "rules.py").write_text("def length(prompts, responses):\n    return [len(r) for r in responses]\n")
    assert load_reward_function("os.path:basename", str(tmp_path)) is __import__("os").path.basename
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        load_reward_function("rules.py:missing", str(tmp_path))
    with pytest.raises(ValueError, match="no file"):
        load_reward_function("nothere.py:f", str(tmp_path))
    (tmp_path / "broken.py").write_text("def f(prompts, responses)\n    return []\n")
    with pytest.raises(ValueError, match=r"broken.py:1: syntax error"):
        load_reward_function("broken.py:f", str(tmp_path))
    with pytest.raises(ValueError, match="rules.py:missing.*has no callable"):
        RewardPool({f"{tmp_path}/rules.py:missing": 1.0}, num_workers=1)


def test_scores_beyond_the_bound_are_named():
    import torch

    from megatron_rlhf.errors import NonFiniteError
    from megatron_rlhf.rewards.pool import check_scores

    with pytest.raises(NonFiniteError, match=r"iteration 3: the reward gave 1e\+30 for response 1 \(prompt 'p1'\).*"
                       r"reward.max_abs_score"):
        check_scores(torch.tensor([0.5, 1e30, float("nan")]), 1e4, 3, ["p0", "p1", "p2"])
    check_scores(torch.tensor([0.5, -1e4]), 1e4, 3, ["p0", "p1"])  # within the bound: no error


TRUTH = '''
import os, time


def check_truth(prompts, responses, ground_truth, data_source):
    """Scores 0, and says whether the row's ground truth is the answer to its question."""
    matches = [float(str(eval(p.replace("= ?", ""))) == t and s in ("add", "sub"))
               for p, t, s in zip(prompts, ground_truth, data_source)]
    marker = os.environ.get("BLOCK_MARKER")
    if marker and os.environ["RANK"] == "1" and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(1e6)  # a verifier stuck on one rank only, once
    return {"score": [0.0] * len(prompts), "truth_matches": matches}
'''


def _math_run(tmp_path, prompt_file, env=None, before_train=True):
    from tests.test_train import metrics, train

    (tmp_path / "truth.py").write_text(TRUTH)
    config = tmp_path / "grpo.yaml"
    config.write_text(
        f"includes: {os.path.abspath('examples/tiny_math/grpo.yaml')}\n"
        f"data:\n  prompt_file: {prompt_file}\n  val_file: {os.path.abspath('examples/tiny_math/val.jsonl')}\n"
        f"reward:\n  functions:\n    {tmp_path}/truth.py:check_truth: 1.0\n  timeout_s: 3\n  num_workers: 1\n"
        f"trainer:\n  val_before_train: {before_train}\n")
    out = tmp_path / "out"
    started = time.monotonic()
    train(out, config=config, env={"ITERATIONS": "2", "ROLLOUT_BATCH_SIZE": "4", "VAL_INTERVAL": "2", **(env or {})})
    return metrics(out), time.monotonic() - started


def test_chat_rows_hand_their_ground_truth_to_the_reward_and_validation_reports(tmp_path):
    rows, _ = _math_run(tmp_path, os.path.abspath("examples/tiny_math/train.jsonl"))
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # validation before training, then 2 iterations
    for row in rows[1:]:
        assert row["reward/check_truth/truth_matches"] == 1.0 and row["reward/failures"] == 0
    for row in (rows[0], rows[2]):
        assert {"val/reward/mean", "val/mean@4", "val/pass@4", "val/add/pass@4", "val/sub/mean@4"} <= set(row)
        assert row["val/reward/failures"] == 0
    assert "val/pass@4" not in rows[1]
    # samples.jsonl: a few rows of each iteration as the run shows them, ground truth included.
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [s["iteration"] for s in samples] == [1] * 4 + [2] * 4
    assert all(s["prompt"].endswith("= ?") and "response" in s and s["score"] == 0.0 and
               str(eval(s["prompt"].replace("= ?", ""))) == s["ground_truth"] for s in samples)


def test_a_parquet_file_and_a_reward_that_blocks_on_one_rank(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = Path("examples/tiny_math/train.jsonl").read_text().splitlines()
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in lines]), tmp_path / "train.parquet")
    # TP=1: 2 data-parallel ranks, each scoring its own rows; only rank 1's verifier blocks.
    rows, seconds = _math_run(tmp_path, tmp_path / "train.parquet", env={"BLOCK_MARKER": str(tmp_path / "blocked"),
                                                                        "TP": "1"}, before_train=False)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[0]["reward/timeouts"] == 1 and rows[0]["reward/failures"] == 1  # rank 1's first call, counted
    assert rows[1]["reward/timeouts"] == 0 and rows[1]["reward/check_truth/truth_matches"] == 1.0
    assert seconds < 60


def test_a_very_long_ground_truth_is_said_at_start_up(tmp_path):
    from megatron_rlhf.startup import prepare
    from megatron_rlhf.train import parse_args

    rows = [json.loads(line) for line in Path("examples/tiny_math/train.jsonl").read_text().splitlines()]
    rows[3]["ground_truth"] = "1" * 20_000  # a whole document in the answer's column
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = tmp_path / "grpo.yaml"
    config.write_text(f"includes: {os.path.abspath('examples/tiny_math/grpo.yaml')}\n"
                      f"data:\n  prompt_file: {tmp_path / 'train.jsonl'}\n  val_file: null\n"
                      "trainer:\n  val_before_train: false\n  val_interval: 0\n")
    with pytest.warns(UserWarning, match=r"train.jsonl.* ground_truth of 20000 characters; the verifier parses it"):
        prepare(parse_args(["--config", str(config), "--output-dir", str(tmp_path / "out")]), 2)
