"""Faults never corrupt a run and always explain themselves (the reliability trials: see
docs/reliability.md). In-process tests of the checks made before start-up, and two launches."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from megatron_rlhf.checkpoint.model_files import CheckpointError
from megatron_rlhf.config import ConfigError, load_config
from megatron_rlhf.checkpoint.run_state import cut_back, run_identity
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args
from tests.conftest import REPO, _free_port
from tests.test_train import metrics, train

TINY = str(REPO / "examples" / "tiny" / "rlhf.yaml")


@pytest.fixture(autouse=True)
def tiny_env(monkeypatch):
    for key in ("TP", "PP", "KL_COEF", "ITERATIONS", "ROLLOUT_BATCH_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)


def prepared(out, *flags):
    return prepare(parse_args(["--config", TINY, "--output-dir", str(out), *flags]), 2)


def fake_checkpoint(out, name, config, tp=2, run=None, **layout):
    """A checkpoint directory as save_checkpoint leaves it (trainer state and manifest only);
    ``layout``: other sizes it was written at (dp, ep)."""
    from megatron_rlhf.checkpoint.model_files import write_manifest

    path = out / "checkpoints" / name
    path.mkdir(parents=True)
    torch.save({"stage": config.stage, "iteration": int(name[-7:]), "steps": {},
                "layout": {"tp": tp, "pp": 1, "dp": 1, **layout}, "run": run or run_identity(config)},
               path / "trainer_state.pt")
    write_manifest(str(path))
    (out / "checkpoints" / "latest").write_text(name)
    return path


def test_overwrite_clears_the_old_run_and_resume_refuses_another_runs_settings(tmp_path, monkeypatch):
    out = tmp_path / "out"
    config = prepared(out).config
    fake_checkpoint(out, "iter_0000004", config)
    (out / "metrics.jsonl").write_text('{"iteration": 1}\n')
    # A finished run with a checkpoint: the refusal says how to continue it.
    with pytest.raises(ConfigError, match=r"already holds a run \(1 iterations.*pass --resume to continue it from iter_0000004"):
        prepared(out)
    monkeypatch.setenv("KL_COEF", "0.5")
    with pytest.raises(ConfigError, match=r"belongs to a run with other settings \(ppo.kl_coef: 0.01 then, 0.5 now\)"):
        prepared(out, "--resume")
    assert prepared(out, "--resume", "--allow-config-change").resume_from.endswith("iter_0000004")
    monkeypatch.setenv("TP", "1")  # another layout: the demo's reference is drawn from the seed per shard
    with pytest.raises(ConfigError, match=r"resumed at another layout \(.*parallel.tensor_model_parallel_size.*\), but "
                                          r"reference has no load"):
        prepare(parse_args(["--config", TINY, "--output-dir", str(out), "--resume", "--allow-config-change"]), 1)
    monkeypatch.delenv("TP")
    prepared(out, "--overwrite")
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("variable, value, said", [
    ("MEGATRON_RLHF_CPU_LINEARS", "mkl", r"MEGATRON_RLHF_CPU_LINEARS='mkl': must be one of onednn, torch"),
    ("MEGATRON_RLHF_DECODE_GRAPHS", "maybe", r"MEGATRON_RLHF_DECODE_GRAPHS='maybe': must be on or off")])
def test_an_engine_switch_of_no_known_value_is_refused_before_start_up(tmp_path, monkeypatch, variable, value, said):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=said):
        prepared(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_truncated_checkpoint_names_its_file_and_the_last_intact_one(tmp_path):
    out = tmp_path / "out"
    config = prepared(out).config
    fake_checkpoint(out, "iter_0000001", config)
    broken = fake_checkpoint(out, "iter_0000002", config)
    state = broken / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{state}: 100 bytes, the manifest says .*truncated.*"
                       r"newest intact checkpoint is .*iter_0000001: to resume from it, write 'iter_0000001'"):
        prepared(out, "--resume")
    # A file the manifest does not list (its entry removed, or added after the save) would be read
    # unchecked: named before start-up, as a damaged one is.
    intact = fake_checkpoint(out, "iter_0000003", config)
    manifest = json.loads((intact / "manifest.json").read_text())
    del manifest["files"]["trainer_state.pt"]
    (intact / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=rf"{intact / 'trainer_state.pt'}: not in the checkpoint's manifest"):
        prepared(out, "--resume")


def test_a_failed_first_iteration_does_not_block_the_retry_and_resume_cuts_back_the_logs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # what a run that died in iteration 1 leaves
    assert prepared(out).resume_from is None
    ledger = out / "memory.jsonl"
    ledger.write_text("".join(json.dumps({"iteration": i, "role": "policy"}) + "\n" for i in (1, 2, 2, 3)))
    cut_back(str(ledger), 2)
    assert [json.loads(line)["iteration"] for line in ledger.read_text().splitlines()] == [1, 2, 2]


def test_input_faults_are_found_before_start_up_with_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="output directory .*: not writable"):
        prepared(tmp_path / "a-file" / "out")
    prompts = tmp_path / "prompts.jsonl"
    monkeypatch.setenv("PROMPT_FILE", str(prompts))
    prompts.write_text('{"prompt": "abc"}\n{"prompt": "  "}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: empty 'prompt'"):
        prepared(tmp_path / "out")
    prompts.write_text('{"prompt": "abc"}\n\n{"prompt": "abC"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:3: character 'C' is not in the tokenizer alphabet"):
        prepared(tmp_path / "out")
    prompts.write_text('{"prompt": "abc"}\n' + json.dumps({"prompt": "a" * 40}) + "\n")
    with pytest.warns(UserWarning, match=r"1 of 2 prompts are longer than data.max_prompt_length=32 tokens"):
        prepared(tmp_path / "out")
    prompts.write_text(json.dumps({"prompt": "b" * 40}) + "\n" + json.dumps({"prompt": "a" * 40}) + "\n")
    with pytest.raises(ConfigError, match=r"every one of the 2 prompts of .*prompts.jsonl is longer than "
                                          r"data.max_prompt_length=32 tokens"):
        prepared(tmp_path / "out")
    with pytest.raises(ConfigError, match="this is a role's model file, not a top config"):
        prepare(parse_args(["--config", str(REPO / "examples/tiny/ppo_policy.yaml")]), 1)


def test_a_verifier_s_missing_or_incomparable_ground_truth_is_refused_before_start_up(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    monkeypatch.setenv("PROMPT_FILE", str(prompts))
    config = tmp_path / "rlhf.yaml"
    config.write_text(f"includes: {TINY}\nreward:\n  function: megatron_rlhf.rewards.verifiers:gsm8k\n")

    def prepare_it():
        return prepare(parse_args(["--config", str(config), "--output-dir", str(tmp_path / "out")]), 2)

    prompts.write_text('{"prompt": "abc", "ground_truth": "1"}\n{"prompt": "abd"}\n')
    with pytest.raises(ConfigError, match=r"reward.function: megatron_rlhf.rewards.verifiers:gsm8k needs the column "
                                          r"'ground_truth', which .*prompts.jsonl:2 does not have \(its columns: none\)"):
        prepare_it()
    for bad in ("null", '{"a": 1}', "[]", "true"):
        prompts.write_text('{"prompt": "abc", "ground_truth": "1"}\n{"prompt": "abd", "ground_truth": %s}\n' % bad)
        with pytest.raises(ConfigError, match=r"prompts.jsonl:2: ground_truth .* is not an answer the verifiers compare"):
            prepare_it()
    prompts.write_text('{"prompt": "abc", "ground_truth": ["1", 2]}\n{"prompt": "abd", "ground_truth": 3.5}\n')
    assert prepare_it().reward_functions


def test_converter_flags_are_checked_and_files_get_the_umask_mode(tmp_path):
    tool = str(REPO / "tools" / "convert_hf_to_megatron.py")
    proc = subprocess.run([sys.executable, tool, "--hf-dir", str(tmp_path), "--output", str(tmp_path / "o"), "--tp", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--tp: '0': expected a whole number >= 1" in proc.stderr
    from megatron_rlhf.checkpoint.model_files import write_atomically

    def fill(tmp):  # a writer that makes its files private, as safetensors does
        fd = os.open(os.path.join(tmp, "model.safetensors"), os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)

    old = os.umask(0o022)
    try:
        write_atomically(str(tmp_path / "hf"), fill)
    finally:
        os.umask(old)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o755


# Called once per response in the one reward worker (TP=2: one scoring rank): 8 responses an iteration.
REWARD = """
calls = [0]


def sometimes_huge(prompts, responses):
    calls[0] += 1
    return [1e30 if calls[0] > 8 else 0.5 for _ in responses]
"""


@pytest.mark.parametrize("mode", ["bound", "skip"])
def test_a_huge_reward_stops_or_skips_and_every_checkpoint_stays_finite(tmp_path, mode):
    (tmp_path / "reward.py").write_text(REWARD)
    config = tmp_path / "rlhf.yaml"
    reward = f"reward:\n  function: {tmp_path}/reward.py:sometimes_huge\n  num_workers: 1\n"
    if mode == "skip":  # the bound raised, so the gradient guard is what stops the steps
        reward += "  max_abs_score: 1.0e+38\n"
    config.write_text(f"includes: {TINY}\n{reward}trainer:\n  save_interval: 1\n"
                      + ("  on_non_finite: skip\n" if mode == "skip" else ""))
    out = tmp_path / "out"
    proc = train(out, config=config, check=False, env={"ITERATIONS": "3", "ROLLOUT_BATCH_SIZE": "8"})
    rows = metrics(out)  # json.loads accepts NaN, so the text is checked too
    assert "NaN" not in (out / "metrics.jsonl").read_text() and "Infinity" not in (out / "metrics.jsonl").read_text()
    if mode == "bound":
        # torchrun prints its own ChildFailedError after it; no frame of the run's code is shown.
        assert proc.returncode != 0 and f'File "{REPO / "megatron_rlhf"}' not in proc.stderr, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "iteration 2: the reward gave 1e+30 for response 0" in errors[0], proc.stderr[-3000:]
        assert len(rows) == 1 and (out / "checkpoints" / "latest").read_text() == "iter_0000001"
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert rows[0]["value/skipped_steps"] == 0 and rows[1]["value/skipped_steps"] > 0
    shards = list((out / "checkpoints").glob("iter_*/ppo_*/release/*/model_optim_rng.pt"))
    assert shards
    for shard in shards:
        weights = torch.load(shard, map_location="cpu", weights_only=False)["model"]
        assert all(torch.isfinite(t).all() for t in weights.values() if torch.is_tensor(t) and t.is_floating_point())


def test_weights_and_biases_without_its_package_is_refused_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without wandb answers
    config = tmp_path / "rlhf.yaml"
    config.write_text(f"includes: {TINY}\ntrainer:\n  wandb: true\n")
    with pytest.raises(ConfigError, match=r"trainer.wandb: true, but the wandb package is not installed; install it "
                                          r"with pip install -e .\[wandb\]"):
        prepare(parse_args(["--config", str(config), "--output-dir", str(tmp_path / "out")]), 2)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_overwrite_keeps_the_old_run_when_an_input_is_bad(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"iteration": 1}\n')
    (out / "run.json").write_text(json.dumps({"config_file": TINY, "stage": "rl"}))  # the demo's earlier run
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "abc"}\n{"text": "no prompt"}\n')
    monkeypatch.setenv("PROMPT_FILE", str(tmp_path / "prompts.jsonl"))
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: no 'prompt'"):
        prepared(out, "--overwrite")
    assert (out / "metrics.jsonl").read_text() == '{"iteration": 1}\n'  # the earlier run is still there


def test_a_torn_log_line_is_dropped_on_resume_and_a_resume_with_nothing_to_do_is_refused(tmp_path):
    out = tmp_path / "out"
    config = prepared(out).config
    fake_checkpoint(out, "iter_0000002", config)
    (out / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n{"iteration": 3, "rew')  # a full disk
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3: a torn record"):
        assert prepared(out, "--resume").resume_from.endswith("iter_0000002")
    with pytest.warns(UserWarning, match="a torn record"):
        cut_back(str(out / "metrics.jsonl"), 2)
    assert [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    with pytest.raises(ConfigError, match=r"iter_0000002 is at iteration 2 and the run is to end at 2 \(--iterations\): "
                                          r"nothing to do; resume with more than 2 iterations"):
        prepared(out, "--resume", "--iterations", "2")


def test_ranks_end_within_seconds_when_their_launcher_is_killed(tmp_path):
    import psutil

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           "-m", "megatron_rlhf.train", "--config", TINY, "--output-dir", str(out)]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", ITERATIONS="40"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert time.monotonic() < deadline and launcher.poll() is None, "the run did not reach iteration 1"
            time.sleep(0.2)
        ranks = psutil.Process(launcher.pid).children()
        assert len(ranks) == 2
        launcher.kill()  # kill -9 of torchrun
        launcher.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"ranks still running 10 s after their launcher died: {[p.pid for p in alive]}"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_one_run_per_output_directory(tmp_path):
    import socket

    from megatron_rlhf.checkpoint.run_state import release_output_dir

    out = tmp_path / "out"
    prepared(out)  # this process now holds the directory's lock, as a running run's rank 0 does
    code = ("from megatron_rlhf.startup import prepare; from megatron_rlhf.train import parse_args; "
            f"prepare(parse_args(['--config', {TINY!r}, '--output-dir', {str(out)!r}]), 2)")
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert second.returncode != 0
    assert f"is in use by another run (host {socket.gethostname()}, pid {os.getpid()}, since " in second.stderr
    release_output_dir(str(out))  # the holder ended
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120).returncode == 0


STALL = """
import os, time


def stall_on_rank_1(prompts, responses):
    marker = os.environ["STALL_MARKER"]
    if os.environ["RANK"] == "1" and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(60)  # within the reward's own time-out: the peer rank waits in its next collective
    return [0.5 for _ in responses]
"""


def test_a_rank_that_does_not_arrive_ends_the_run_with_a_line_naming_the_phase(tmp_path):
    (tmp_path / "stall.py").write_text(STALL)
    config = tmp_path / "rlhf.yaml"
    config.write_text(f"includes: {TINY}\nreward:\n  function: {tmp_path}/stall.py:stall_on_rank_1\n  timeout_s: 120\n"
                      "trainer:\n  collective_timeout_s: 5\n")
    started = time.monotonic()
    proc = train(tmp_path / "out", config=config, check=False,
                 env={"TP": "1", "ITERATIONS": "2", "STALL_MARKER": str(tmp_path / "stalled")}, timeout=120)
    assert proc.returncode != 0 and time.monotonic() - started < 50
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "iteration 1, " in errors[0] and "a collective waited longer than trainer.collective_timeout_s=5s" in errors[0]
    assert "elsewhere: rank 1 in iteration 1, policy (inference) for " in errors[0]  # the rank that did not arrive


def test_a_reward_error_that_says_timed_out_is_not_taken_for_a_collectives():
    from megatron_rlhf.errors import RewardFunctionError
    from megatron_rlhf.run_loop import _peer_problem

    said = "the first 4 reward calls of the batch all timed out; ... took over 3s (reward.timeout_s)"
    assert _peer_problem(RewardFunctionError(said), 1800) is None
    assert _peer_problem(RuntimeError("[gloo] Timed out waiting 1800000ms"), 1800).startswith("a collective waited")


def test_a_rank_gone_without_a_word_is_named_as_such(tmp_path, monkeypatch):
    """kill -9 of a rank (or the OOM killer): the survivor's line names the rank whose process is gone,
    not "its own output says why" (it printed nothing)."""
    import socket

    from megatron_rlhf.run_loop import _ranks_elsewhere

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host, now = socket.gethostname(), time.time()
    (tmp_path / "rank0").write_text(f"3\tppo_policy (training)\t{now:.0f}\t{host}\t{os.getpid()}")
    (tmp_path / "rank1").write_text(f"3\tppo_policy (training)\t{now:.0f}\t{host}\t{ended.pid}")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    said = _ranks_elsewhere(str(tmp_path), 3, "ppo_policy (training)", "iteration")
    assert said.startswith(f"rank 1 (pid {ended.pid}) ended in iteration 3, ppo_policy (training), without a word: "
                           "killed (the kernel's out-of-memory killer says so in dmesg) or crashed"), said
    (tmp_path / "rank1").write_text(f"3\tppo_policy (training)\t{now:.0f}\t{host}\t{os.getpid()}")
    assert _ranks_elsewhere(str(tmp_path), 3, "ppo_policy (training)", "iteration").startswith(
        "every rank recorded this phase")


def test_overwrite_puts_the_old_run_back_when_the_launch_fails_before_its_first_iteration(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints" / "iter_0000003").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n{"iteration": 3}\n')
    wrong = tmp_path / "wrong_ckpt"  # a checkpoint that exists but does not fit: found when the model is built
    wrong.mkdir()
    arch = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                vocab_size=128, max_position_embeddings=256)
    (wrong / "megatron_rlhf_model.json").write_text(json.dumps({"arch": arch, "head": "lm", "dtype": "float32",
                                                                "tp": 1, "pp": 1}))
    config = tmp_path / "rlhf.yaml"
    config.write_text(f"includes: {TINY}\nreference:\n  load: {wrong}\n")
    (out / "run.json").write_text(json.dumps({"config_file": str(config), "stage": "rl"}))  # this config's earlier run
    proc = train(out, "--overwrite", config=config, check=False)
    assert proc.returncode != 0 and "does not fit the configured model" in proc.stderr, proc.stderr[-3000:]
    assert (out / "metrics.jsonl").read_text().count("iteration") == 3 and (out / "checkpoints" / "iter_0000003").is_dir()
    assert not (out / ".overwritten").exists()
    # A launch killed before its first iteration leaves the set-aside run: the next launch puts it back.
    (out / ".overwritten").mkdir()
    (out / "metrics.jsonl").rename(out / ".overwritten" / "metrics.jsonl")
    (out / "metrics.jsonl").write_text("")
    with pytest.warns(UserWarning, match="put back the run an --overwrite launch set aside"):
        with pytest.raises(ConfigError, match=r"already holds a run \(3 iterations"):
            prepared(out)


def test_resume_may_change_how_the_work_is_cut_but_not_what_it_computes(tmp_path):
    from megatron_rlhf.config import load_config
    from tests.test_config import _role_setup

    def fingerprint(role, lines):
        return run_identity(load_config(str(_role_setup(tmp_path, role, lines)), world_size=1, check_inputs=False))["fingerprint"]

    base = fingerprint("policy", "")
    # The served roles' own layouts and micro-batch sizing change only how the work is cut.
    assert fingerprint("policy", "  parallel: {tensor_model_parallel_size: 1}\n") == base
    assert fingerprint("ppo_policy", "  micro_batch_size: auto\n  max_tokens_per_micro_batch: 512\n") == base
    # What the numbers depend on is not free (a trained role's learning rate here).
    assert fingerprint("ppo_policy", "  lr: 0.5\n") != base


# -- round four (issue 55): agents, tools, LoRA, partial rollouts, the launcher ---------------------

def test_an_environment_reply_is_cut_to_its_limit_before_the_room_is_measured(tmp_path):
    from tests.test_multiturn import _turns

    # Replies of 50 tokens, max_observation_tokens 4, room for 12: each reply loses its middle and the
    # turns go on (before: the uncut reply did not fit and the trajectory ended, a huge first one at once).
    (rows, metrics), tok = _turns(tmp_path, """
        class Env:
            def start(self, row):
                return "b" * 50
            def step(self, turn):
                return "c" * 50, False, None, {}
    """, max_turns=2, max_observation_tokens=4, max_trajectory_tokens=16)
    one = [1, 4] + tok.encode("bbbb") + tok.encode("a") + [2] + tok.encode("cccc") + tok.encode("a") + [2]
    assert rows["tokens"][0].tolist() == one
    assert metrics["rollout/truncated_observations"] == 4 and metrics["rollout/context_truncated"] == 0


def test_an_environment_s_values_are_checked_and_it_is_named():
    from megatron_rlhf.agents.protocol import ProtocolError, check_constructible, checked_step

    for bad, words in [((None, False, float("inf"), {}), "step returned reward=inf; a per-turn reward is a finite"),
                       ((None, False, None, {"counts": {"tool_calls": float("inf")}}), "counts map names"),
                       ((None, False, None, {"counts": {"env_x": float("-inf")}}), "to finite numbers")]:
        with pytest.raises(ProtocolError, match=words):
            checked_step(bad)

    class NeedsLevel:
        def __init__(self, level):
            self.level = level

    with pytest.raises(ValueError, match=r"environment 'envs.py:NeedsLevel': one instance per trajectory is made with "
                                         r"no arguments, but missing a required argument: 'level'"):
        check_constructible(NeedsLevel, {}, "envs.py:NeedsLevel")


def test_an_environment_that_blocks_ends_the_batch_as_the_reward_pool_does(tmp_path):
    from megatron_rlhf.rollout.env_pool import EnvironmentPool

    (tmp_path / "envs.py").write_text("import time\nclass Env:\n    def start(self, row):\n        time.sleep(600)\n"
                                      "    def step(self, turn):\n        pass\n")
    pool = EnvironmentPool(f"{tmp_path / 'envs.py'}:Env", num_workers=2, timeout_s=0.5)
    started = time.monotonic()
    try:
        outcomes = pool.call([(i, "start", {"prompt": "x"}) for i in range(64)])
    finally:
        pool.close()
    assert time.monotonic() - started < 15  # before: 64 time-outs one after another per worker (16 s here, 16 min at 30 s)
    assert sum(kind == "timeout" for kind, _ in outcomes) == 64
    assert sum("was not made: the first 4 calls of the batch all timed out" in why for _, why in outcomes) == 60


def test_an_environment_that_keeps_growing_is_stopped_and_its_neighbours_rebuilt(tmp_path):
    """An environment holding 40 MB more each step (issue 65's grew by 2 MB a step, unbounded): the
    call that takes its worker past env_memory_mb fails, named, and the worker is replaced; the
    trajectory that shared it is rebuilt by replay and goes on."""
    from megatron_rlhf.rollout.env_pool import EnvironmentPool, resident_mb

    (tmp_path / "envs.py").write_text(textwrap.dedent("""
        class Env:
            def start(self, row):
                self.grows, self.held, self.n = row["prompt"] == "grow", [], 0
                return "go"
            def step(self, turn):
                self.n += 1
                if self.grows:
                    self.held.append(bytearray(40 << 20))
                return f"step {self.n}", False, None, {}
    """))
    pool = EnvironmentPool(f"{tmp_path / 'envs.py'}:Env", num_workers=1, timeout_s=5.0)
    pool.memory_mb = resident_mb(pool.workers[0].process.pid) + 100  # room for two steps of growth
    turn = {"text": "x", "token_ids": [1], "index": 0, "ended": True}
    try:
        pool.call([(0, "start", {"prompt": "grow"}), (1, "start", {"prompt": "steady"})])
        outcomes = [pool.call([(0, "step", turn), (1, "step", turn)]) for _ in range(4)]
    finally:
        pool.close()
    grown = [kind for (kind, _), _ in outcomes]
    assert grown[:2] == ["ok", "ok"] and grown[2] == "memory", outcomes
    assert "beyond rollout.env_memory_mb" in outcomes[2][0][1]
    steady = [answer.observation for _, (kind, answer) in outcomes if kind == "ok"]
    assert steady == ["step 1", "step 2", "step 3", "step 4"]  # rebuilt by replay after the replacement


def test_a_tool_that_exits_hangs_or_is_called_with_deep_json_is_answered_and_poisons_nothing(tmp_path):
    from megatron_rlhf.agents.protocol import Turn
    from megatron_rlhf.agents.tool_environment import ToolEnvironment

    (tmp_path / "t.py").write_text(textwrap.dedent('''
        import sys, time

        def leave(code: int) -> str:
            """Exit.

            Args:
                code: The exit code.
            """
            sys.exit(code)

        def hang(seconds: int) -> str:
            """Sleep.

            Args:
                seconds: How long.
            """
            time.sleep(seconds)
            return "woke"

        def add(a: int, b: int) -> int:
            """Add.

            Args:
                a: One.
                b: The other.
            """
            return a + b
    '''))
    env = ToolEnvironment([f"{tmp_path / 't.py'}:{n}" for n in ("leave", "hang", "add")], "hermes",
                          max_parallel_calls=1, tool_timeout_s=0.5)

    def call(body):
        result = env.step(Turn(f"<tool_call>{body}</tool_call>", [], 0, True))
        return result.observation[0]["content"], result.info["counts"]

    assert call('{"name": "leave", "arguments": {"code": 3}}') == ("error: leave called sys.exit(3)", call.__defaults__
                                                                   or {"tool_calls": 1.0, "tool_errors": 1.0,
                                                                       "tool_timeouts": 0.0, "tool_calls/leave": 1.0,
                                                                       "tool_s": pytest.approx(0.0, abs=0.5)})
    for _ in range(3):  # three hung calls in a row: each times out alone
        assert call('{"name": "hang", "arguments": {"seconds": 30}}')[0] == "error: hang did not answer within 0.5s"
    assert call('{"name": "add", "arguments": {"a": 2, "b": 3}}')[0] == "5"  # before: queued behind the hung ones
    deep = "[" * 100000 + "]" * 100000
    assert call(deep)[0] == "error: the tool call is nested 100000 levels deep; at most 100 are read"
    reply, counts = call('{"name": "add", "arguments": {"a": %s, "b": 1}}' % deep)
    assert reply == "error: the tool call is nested 100002 levels deep; at most 100 are read"
    assert counts["tool_errors"] == 1 and counts["tool_errors/depth"] == 1


def test_stop_strings_that_cannot_end_a_turn_are_refused_by_name(tmp_path):
    from megatron_rlhf.data.tokenizer import CharTokenizer
    from megatron_rlhf.startup import _check_stop_strings
    from tests.test_config import tiny_setup

    config_of = lambda stop: load_config(str(tiny_setup(tmp_path, "rollout: {environment: env.py:Game, stop: %s, "  # noqa: E731
                                                                   "max_trajectory_tokens: 200}\n" % stop)), world_size=1)
    with pytest.raises(ConfigError, match=r"rollout.stop: \[''\] holds an empty string .* would end every turn at its "
                                          r"first token"):
        config_of("['']")
    with pytest.raises(ConfigError, match=r"rollout.stop: 'END' cannot be written by the tokenizer \(.*\); use text "
                                          r"within its vocabulary"):
        _check_stop_strings(config_of("['END']"), CharTokenizer("abc >"))


def test_a_value_outside_its_domain_is_reported_once_without_its_consequences(tmp_path):
    from tests.test_config import _role_setup, tiny_setup

    cases = [(lambda: _role_setup(tmp_path, "ppo_policy", "  lora: {rank: -1, alpha: 8}\n"),
              "ppo_policy.lora.rank: must be >= 0, got -1"),
             (lambda: tiny_setup(tmp_path, "rollout: {environment: env.py:Game, max_turns: 0, max_trajectory_tokens: 200}\n"),
              "rollout.max_turns: must be >= 1, got 0"),
             (lambda: tiny_setup(tmp_path, "algorithm: {rollout_correction: {mode: truncate, threshold: 0}}\n"),
              "algorithm.rollout_correction.threshold: must be > 0, got 0.0")]
    for setup, only in cases:
        with pytest.raises(ConfigError) as err:
            load_config(str(setup()), world_size=1)
        problems = str(err.value).splitlines()[1:]
        assert len(problems) == 1 and problems[0].strip().endswith(only), str(err.value)


def test_resume_refuses_a_network_of_another_shape_even_when_settings_may_change(tmp_path):
    import dataclasses

    from megatron_rlhf.checkpoint.run_state import check_resume

    config = load_config(str(REPO / "examples" / "tiny" / "grpo_lora.yaml"), world_size=2)
    path = fake_checkpoint(tmp_path, "iter_0000002", config)
    wider = copy_config(config, lora=dataclasses.replace(config.ppo_policy.lora, rank=config.ppo_policy.lora.rank * 2))
    with pytest.raises(ConfigError, match=r"holds networks of other shapes \(ppo_policy.lora.rank: 8 then, 16 now\): its "
                                          r"tensors cannot be loaded into these, --allow-config-change or not"):
        check_resume(str(path), wider, run_identity(wider), str(tmp_path), allow_config_change=True)


def copy_config(config, lora):
    import copy

    other = copy.deepcopy(config)
    other.ppo_policy.lora = lora
    return other


def test_resuming_partial_rollouts_of_prompts_a_shorter_file_lacks_or_of_another_kind_is_refused(tmp_path):
    from megatron_rlhf.checkpoint.model_files import write_manifest
    from megatron_rlhf.startup import _check_held_groups

    config = load_config(TINY, world_size=2)
    path = tmp_path / "iter_0000003"
    path.mkdir()
    torch.save({"steps": {"partial": {"held": {"prompt_index": torch.tensor([3, 70, 12])}}}}, path / "trainer_state.pt")
    write_manifest(str(path))
    _check_held_groups(config, str(path), 71)
    with pytest.raises(ConfigError, match=r"data.prompt_file.*: 64 prompts, but .* holds partial rollouts of prompt 71 \("
                                          r"the file it was written with was longer\)"):
        _check_held_groups(config, str(path), 64)
    # Held trajectories (written with an environment) are refused by a run without one, and the
    # held prompts of trajectories are checked alike.
    torch.save({"steps": {"partial": {"held": [{"prompt_index": 3}, {"prompt_index": 70}]}}}, path / "trainer_state.pt")
    with pytest.raises(ConfigError, match=r"holds partial rollouts with an environment, and this run has none"):
        _check_held_groups(config, str(path), 71)
    config.rollout.environment = "env.py:Game"
    _check_held_groups(config, str(path), 71)
    with pytest.raises(ConfigError, match=r"64 prompts, but .* holds partial rollouts of prompt 71 \("):
        _check_held_groups(config, str(path), 64)


def test_a_load_checkpoint_without_its_manifest_is_read_to_the_end_of_each_file_at_start_up(tmp_path):
    from megatron_rlhf.checkpoint.model_files import check_readable

    shard = tmp_path / "ckpt" / "mp_rank_00" / "model_optim_rng.pt"
    shard.parent.mkdir(parents=True)
    torch.save({"model": {"w": torch.ones(1000)}}, shard)
    check_readable(str(tmp_path / "ckpt"))
    shard.write_bytes(shard.read_bytes()[:-200])
    with pytest.raises(CheckpointError, match=r"mp_rank_00/model_optim_rng.pt: damaged or truncated"):
        check_readable(str(tmp_path / "ckpt"))


def test_a_worker_whose_run_ended_ends_quietly(tmp_path):
    import socket

    (tmp_path / "slow.py").write_text("import time\ndef score(prompts, responses):\n    time.sleep(0.5)\n"
                                      "    return [1.0] * len(prompts)\n")
    parent, child = socket.socketpair()
    worker = subprocess.Popen([sys.executable, "-m", "megatron_rlhf.rewards.worker", str(child.fileno()),
                               f"{tmp_path / 'slow.py'}:score"], pass_fds=[child.fileno()], stderr=subprocess.PIPE, text=True)
    child.close()
    from multiprocessing.connection import Connection

    conn = Connection(parent.detach())
    assert conn.recv() == ("ready", None)
    conn.send([(0, "p", "r", {})] * 4)  # the run fails at start-up while the worker scores: it goes away
    conn.close()
    assert worker.wait(timeout=30) == 0 and "Traceback" not in worker.stderr.read()


def test_a_torn_ledger_line_is_passed_over_at_resume_and_a_ledger_that_cannot_be_written_is_one_line(tmp_path):
    """memory.jsonl after a full disk (its last line torn): the resumed run's ledger numbers its
    moments after the last whole record (it died on the torn line); a ledger write that fails
    (no room, or no file to write) is a RunError naming the file."""
    from megatron_rlhf.errors import RunError
    from megatron_rlhf.memory import MemoryLedger

    path = tmp_path / "memory.jsonl"
    path.write_text('{"moment": 6, "iteration": 2}\n{"moment": 7, "iteration": 2}\n{"moment": 8, "itera')
    assert MemoryLedger(str(path)).moments == 8
    ledger = MemoryLedger(str(tmp_path / "unwritable.jsonl"))
    (tmp_path / "unwritable.jsonl").mkdir()  # any OSError of the write (ENOSPC alike)
    with pytest.raises(RunError, match=r"writing the memory ledger .*unwritable.jsonl failed: Is a directory; the last "
                                       r"complete checkpoint is kept"):
        ledger.record("phase_end", "iteration")


def test_our_warnings_print_as_one_line_of_ours_and_others_as_python_prints_them():
    """A warning of the project's own (the start-up's end-token notice, say) is one `warning:` line, not
    Python's file, line, category and source line; a library's keeps Python's form."""
    from megatron_rlhf import errors, startup

    said = errors._ours_as_one_line("the vocabulary has </s>, which do not end a response", UserWarning,
                                    startup.__file__, 375, "warnings.warn(...)")
    assert said == "warning: the vocabulary has </s>, which do not end a response\n"
    theirs = errors._ours_as_one_line("Apex is not installed", UserWarning, "/usr/lib/python3/site-packages/x.py", 3, "")
    assert "UserWarning: Apex is not installed" in theirs and theirs.startswith("/usr/lib/python3/site-packages/x.py:3")
