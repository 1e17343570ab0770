"""Critic-free RL end to end on the tiny demo (examples/tiny/grpo.yaml): GRPO learns, is the same
with EMS on and off, builds no critic; dynamic sampling drops groups without signal and refills
the batch."""

import json

import pytest

from tests.conftest import run_workers
from tests.test_train import FREE_MEMORY_VARS, metrics, train, without_times

GRPO = "examples/tiny/grpo.yaml"


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("grpo")
    runs = {}
    for name, ems, iterations in (("on", "True", "12"), ("off", "False", "6")):  # EMS compared over the first 6
        runs[name] = train(base / name, config=GRPO, env={"ITERATIONS": iterations, **{v: ems for v in FREE_MEMORY_VARS}})
    return base, runs


def test_grpo_demo_learns_without_a_critic(grpo_runs):
    base, runs = grpo_runs
    rows = metrics(base / "on")
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first + 0.1, (first, last)
    assert all("policy/kl" in r and "loss/value" not in r and "values/mean" not in r for r in rows)
    assert "loss/policy" in runs["on"].stdout and "loss/value" not in runs["on"].stdout
    ledger = [json.loads(line) for line in (base / "on" / "memory.jsonl").read_text().splitlines()]
    assert {r["role"] for r in ledger} == {"policy", "reference", "ppo_policy"}
    saved = next((base / "on" / "checkpoints").glob("iter_*"))
    assert sorted(p.name for p in saved.iterdir() if p.is_dir()) == ["ppo_policy"]


def test_grpo_ems_changes_no_number(grpo_runs):
    base, _ = grpo_runs
    assert without_times(metrics(base / "on"))[:6] == without_times(metrics(base / "off"))


def test_dynamic_sampling_drops_groups_without_signal_and_refills(tmp_path):
    ranks = run_workers(tmp_path, 2, "dynamic_sampling")
    served = ranks[0].served  # every prompt drawn this iteration, in order (8 per round)
    n, prompts_per_iteration = 4, 8
    informative = [p for p in served if p >= "n"]
    assert len(informative) >= prompts_per_iteration, "too few informative prompts for the test"
    m = ranks[0].metrics
    rounds = len(served) // prompts_per_iteration
    assert m["sampling/rounds"] == rounds >= 2 and m["sampling/short_groups"] == 0
    assert m["sampling/dropped_groups"] == sum(p < "n" for p in served) > 0
    # Each DP rank holds its half of the first 8 informative groups, in the order drawn.
    for rank, result in enumerate(ranks):
        expected = informative[rank * 4 : (rank + 1) * 4]
        assert result.prompts == [p for p in expected for _ in range(n)]
        groups = result.scores.reshape(-1, n)
        assert (groups.max(dim=1).values > groups.min(dim=1).values).all()
        assert result.advantages.abs().sum() > 0
