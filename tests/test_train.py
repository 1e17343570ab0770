"""The PPO entry point end to end on the tiny example (2 processes, gloo): the demo learns, EMS
changes no number, and bad input stops the run before any model is built."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, spawn_ranks

FREE_MEMORY_VARS = [f"free_memory_{r}" for r in ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value")]


def train(out: Path, *args: str, nprocs: int = 2, env=None, config="examples/tiny/rlhf.yaml", check=True, timeout=600):
    """``python -m megatron_rlhf.train`` as torchrun starts it on ``nprocs`` ranks (conftest.spawn_ranks:
    its environment, without its process); the ranks' standard outputs and errors joined in rank
    order, and the first failed rank's exit code, as a CompletedProcess."""
    import tempfile

    cmd = [sys.executable, "-u", "-m", "megatron_rlhf.train", "--config", str(config), "--output-dir", str(out), *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env.update(env or {})
    with tempfile.TemporaryDirectory() as logs:
        ranks = spawn_ranks(cmd, nprocs, full_env, timeout, Path(logs), stderr_apart=True)
    code = next((code for code, _, _ in ranks if code != 0), 0)
    proc = subprocess.CompletedProcess(cmd, code, "".join(o for _, o, _ in ranks), "".join(e for _, _, e in ranks))
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def metrics(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_times(rows):
    from megatron_rlhf.rollout.record import SCHEDULE_METRICS

    return [{k: v for k, v in row.items() if not k.startswith("time/") and k not in SCHEDULE_METRICS} for row in rows]


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """The demo (as `make demo` runs it) for 25 of its 40 iterations with free_memory on for every
    role (enough to show it learns: +0.52 by 25 on the CI's VM), and its first 6 with it off."""
    base = tmp_path_factory.mktemp("demo")
    on = train(base / "on", env={**{v: "True" for v in FREE_MEMORY_VARS}, "ITERATIONS": "25"})
    off = train(base / "off", env={**{v: "False" for v in FREE_MEMORY_VARS}, "ITERATIONS": "6"})
    return base, on, off


def test_the_demo_learns(demo_runs):
    base, on, _ = demo_runs
    rows = metrics(base / "on")
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) == 25
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first + 0.2, (first, last)
    assert "done:" in on.stdout and "iter" in on.stdout


def test_the_kv_cache_is_in_the_ledger_for_generation_only_and_as_planned(demo_runs, monkeypatch):
    from megatron_rlhf.config import load_config
    from megatron_rlhf.memory.planner import plan

    base, _, _ = demo_runs
    records = [json.loads(line) for line in (base / "on" / "memory.jsonl").read_text().splitlines()]
    policy = [r for r in records if r["role"] == "policy"]
    allocated = [r["bytes"]["kv_cache"] for r in policy if r["event"] == "allocate"]
    monkeypatch.setenv("TP", "2")
    expected = plan(load_config(str(REPO / "examples/tiny/rlhf.yaml"), world_size=2), 2).transient["policy"]["kv_cache"]
    assert len(allocated) == len(metrics(base / "on")) and set(allocated) == {expected} and expected > 0
    assert all(r["bytes"]["kv_cache"] == 0 for r in policy if r["event"] != "allocate")
    assert all(r["transient_bytes"] == r["bytes"]["kv_cache"] for r in policy)


def test_every_iteration_runs_its_roles_in_the_declared_phase_order(demo_runs):
    from megatron_rlhf.config.schema import PHASE_ORDER

    base, _, _ = demo_runs
    records = [json.loads(line) for line in (base / "on" / "memory.jsonl").read_text().splitlines()]
    by_iteration, ended = {}, set()
    for r in records:  # up to the iteration's end (a checkpoint save brings trained roles back after it)
        order = by_iteration.setdefault(r["iteration"], [])
        if r["event"] == "phase_end" and r["phase"] == "iteration":
            ended.add(r["iteration"])
        elif r["iteration"] not in ended and r["active_role"] and (not order or order[-1] != r["active_role"]):
            order.append(r["active_role"])
    declared = [role for _, role in PHASE_ORDER if role in ("policy", "reference", "value", "ppo_policy", "ppo_value")]
    assert len(by_iteration) == len(metrics(base / "on")) and all(o == declared for o in by_iteration.values())


def test_overlapped_onloads_change_no_number(demo_runs):
    base, _, _ = demo_runs
    run = train(base / "overlap", env={**{v: "True" for v in FREE_MEMORY_VARS}, "ITERATIONS": "3", "OVERLAP_ONLOAD": "True"})
    assert "overlapping policy -> reference, reference -> value, value -> ppo_policy, ppo_policy -> ppo_value" in run.stdout
    assert without_times(metrics(base / "overlap")) == without_times(metrics(base / "on"))[:3]
    records = [json.loads(line) for line in (base / "overlap" / "memory.jsonl").read_text().splitlines()]
    # While ppo_policy trains, ppo_value's whole training state is already back on the device.
    prefetched = [r for r in records if r["event"] == "prefetch" and r["role"] == r["active_role"] == "ppo_value"]
    assert len(prefetched) == 3 and all(all(r["bytes"][k] > 0 for k in ("weights", "grads", "optimizer_state"))
                                        for r in prefetched[1:])


def test_host_arenas_are_as_planned_and_frozen_weights_are_copied_once(demo_runs, monkeypatch):
    from megatron_rlhf.config import load_config
    from megatron_rlhf.memory.planner import plan

    base, _, _ = demo_runs
    records = [json.loads(line) for line in (base / "on" / "memory.jsonl").read_text().splitlines()]
    last = {r["role"]: r for r in records if r["moment"] == records[-1]["moment"]}
    monkeypatch.setenv("TP", "2")
    planned = plan(load_config(str(REPO / "examples/tiny/rlhf.yaml"), world_size=2), 2)
    assert {role: r["host_bytes"] for role, r in last.items()} == planned.host and planned.host["reference"] > 0
    # The policy and value serve their trained roles' weights (shared storage): no arena of their own.
    assert planned.host["policy"] == planned.host["value"] == 0
    # The reference never changes: its weights went to the host once, when it was built.
    assert {r["host_copied_bytes"] for r in records if r["role"] == "reference"} == {planned.host["reference"]}


def test_free_memory_changes_no_number(demo_runs):
    base, _, _ = demo_runs
    assert without_times(metrics(base / "on"))[:6] == without_times(metrics(base / "off"))


def test_free_memory_auto_chooses_at_start_up_says_why_and_changes_no_number(demo_runs):
    base, _, _ = demo_runs
    run = train(base / "auto", env={**{v: "auto" for v in FREE_MEMORY_VARS}, "ITERATIONS": "3"})
    choice = json.loads((base / "auto" / "free_memory_auto.json").read_text())
    assert set(choice["roles"]) == {"policy", "reference", "value", "ppo_policy", "ppo_value"}
    # The CPU's free RAM holds the tiny demo with nothing offloaded: the fewest offloads are none.
    assert choice["chosen"] == {r: [] for r in choice["roles"]} and choice["device_free_bytes"] > choice["peak_bytes"]
    assert f"free_memory: auto: {choice['reason']}" in run.stdout and "offloading nothing gives" in choice["reason"]
    assert without_times(metrics(base / "auto")) == without_times(metrics(base / "on"))[:3]


def test_metrics_ledger_and_tensorboard_are_written(demo_runs):
    base, _, _ = demo_runs
    rows = metrics(base / "on")
    for key in ("iteration", "reward/mean", "kl/mean", "loss/policy", "loss/value", "time/iteration_s"):
        assert all(key in r for r in rows), key
    # The reference is the initial policy: no KL before the first update, KL after it.
    assert rows[0]["kl/mean"] == 0.0 and any(r["kl/mean"] != 0.0 for r in rows[1:])
    assert list((base / "on" / "tensorboard").glob("events.out.tfevents.*"))
    ledger = [json.loads(line) for line in (base / "on" / "memory.jsonl").read_text().splitlines()]
    assert {r["role"] for r in ledger} == {"policy", "reference", "value", "ppo_policy", "ppo_value"}
    # policy shares ppo_policy's storage: it counts no weights of its own; ppo_policy's go to host
    # memory between phases when every role frees its memory, and stay when none does.
    assert all(r["bytes"]["weights"] == 0 for r in ledger if r["role"] == "policy")
    idle = [r for r in ledger if r["role"] == "ppo_policy" and r["active_role"] == "reference"]
    assert idle and all(r["bytes"]["weights"] == 0 for r in idle)
    ledger_off = [json.loads(line) for line in (base / "off" / "memory.jsonl").read_text().splitlines()]
    assert all(r["bytes"]["weights"] > 0 for r in ledger_off if r["role"] == "ppo_policy")


def test_memory_report_draws_the_timeline_beside_the_plan(demo_runs, tmp_path):
    import subprocess

    base, _, _ = demo_runs
    png = tmp_path / "timeline.png"
    proc = subprocess.run(
        [sys.executable, "tools/memory_report.py", str(base / "on"), "--config", "examples/tiny/rlhf.yaml", "--png", str(png)],
        cwd=REPO, capture_output=True, text=True, env=dict(os.environ, TP="2"),
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "peak:" in proc.stdout and "largest role: ppo_policy" in proc.stdout


def test_reward_model_under_pipeline_parallelism(tmp_path):
    """A scalar-head reward model instead of the rule, on 2 pipeline stages."""
    config = tmp_path / "rlhf.yaml"
    config.write_text(
        f"includes: {REPO / 'examples/tiny/rlhf.yaml'}\n"
        "reward: {type: model, function: null, free_memory: true}\n"
    )
    train(tmp_path / "out", "--iterations", "2", config=config, env={"TP": "1", "PP": "2"})
    rows = metrics(tmp_path / "out")
    assert len(rows) == 2 and all(abs(r["reward/mean"]) < 10 for r in rows)
    assert rows[0]["reward/mean"] != 0.0 and rows[0]["kl/mean"] == 0.0


def test_context_parallelism_learns_as_one_rank_does(tmp_path):
    """PPO with a critic and a reward model, responses of 48 tokens (ignore_eos): 3 iterations at CP=2
    on 2 ranks give the metrics of the same run on 1 rank, within rounding."""
    config = tmp_path / "rlhf.yaml"
    config.write_text(f"includes: {REPO / 'examples/tiny/rlhf.yaml'}\n"
                      "reward: {type: model, function: null}\ngeneration: {max_new_tokens: 48, ignore_eos: true}\n")
    for cp, nprocs in ((1, 1), (2, 2)):
        train(tmp_path / f"cp{cp}", config=config, nprocs=nprocs, env={"TP": "1", "CP": str(cp), "ITERATIONS": "3"})
    one, two = (without_times(metrics(tmp_path / f"cp{cp}")) for cp in (1, 2))
    assert len(one) == len(two) == 3 and all(r["response/length_mean"] == 48 for r in one)
    for a, b in zip(one, two):
        assert sorted(a) == sorted(b)
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["iteration"], key)


def test_packed_rows_learn_as_padded_rows_do(tmp_path):
    """PPO with a critic and a reward model, 3 iterations on 2 ranks (DP=2): every role's passes on
    packed rows (micro-batches cut by real tokens, the update's rows dealt over DP by them) give the
    padded run's metrics within rounding."""
    config = tmp_path / "rlhf.yaml"
    config.write_text(f"includes: {REPO / 'examples/tiny/rlhf.yaml'}\nreward: {{type: model, function: null}}\n")
    packed = [f"{role}.pack_rows=true" for role in ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value")]
    for name, overrides in (("padded", []), ("packed", packed)):
        train(tmp_path / name, *overrides, config=config, env={"TP": "1", "ITERATIONS": "3"})
    padded, packed = (without_times(metrics(tmp_path / name)) for name in ("padded", "packed"))
    assert len(padded) == len(packed) == 3 and padded[0]["response/length_mean"] < 16  # rows of unequal lengths
    for a, b in zip(padded, packed):
        assert sorted(a) == sorted(b)
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["iteration"], key)


def test_an_existing_run_is_not_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"iteration": 1}\n')
    proc = train(out, check=False, nprocs=1, env={"TP": "1"})
    assert proc.returncode != 0 and "already holds a run" in proc.stderr and "--overwrite" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == '{"iteration": 1}\n'


@pytest.mark.parametrize(
    "env, message",
    [
        ({"PROMPT_FILE": "/nonexistent/prompts.jsonl"}, "data.prompt_file (environment variable PROMPT_FILE=/nonexistent/prompts.jsonl): /nonexistent/prompts.jsonl: no such file"),
        ({"ROLLOUT_BATCH_SIZE": "6"}, "ppo_policy.global_batch_size: 8 does not divide the rollout of 6 samples (ppo.rollout_batch_size=6)"),
        ({"MAX_NEW_TOKENS": "300"}, "exceeds policy's max_position_embeddings=256"),
    ],
)
def test_bad_input_stops_before_any_model_is_built(tmp_path, env, message):
    proc = train(tmp_path / "out", check=False, nprocs=1, env={"TP": "1", **env})
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()
