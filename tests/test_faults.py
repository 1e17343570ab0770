"""Faults never corrupt a run and always explain themselves (the reliability trials: see
docs/reliability.md). In-process tests of the checks made before start-up, and two launches."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from megatron_rlhf.checkpoint.model_files import CheckpointError
from megatron_rlhf.config import ConfigError
from megatron_rlhf.checkpoint.run_state import cut_back, run_identity
from megatron_rlhf.train import parse_args, prepare
from tests.conftest import REPO, _free_port
from tests.test_train import metrics, train

TINY = str(REPO / "examples" / "tiny" / "rlhf.yaml")


@pytest.fixture(autouse=True)
def tiny_env(monkeypatch):
    for key in ("TP", "PP", "KL_COEF", "ITERATIONS", "ROLLOUT_BATCH_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)


def prepared(out, *flags):
    return prepare(parse_args(["--config", TINY, "--output-dir", str(out), *flags]), 2)


def fake_checkpoint(out, name, config, tp=2, run=None):
    """A checkpoint directory as save_ppo_checkpoint leaves it (trainer state and manifest only)."""
    from megatron_rlhf.checkpoint.model_files import _checksum

    path = out / "checkpoints" / name
    path.mkdir(parents=True)
    torch.save({"iteration": int(name[-7:]), "layout": {"tp": tp, "pp": 1, "dp": 1}, "run": run or run_identity(config)},
               path / "trainer_state.pt")
    file = path / "trainer_state.pt"
    (path / "manifest.json").write_text(json.dumps({"trainer_state.pt": {"bytes": file.stat().st_size,
                                                                         "crc32": _checksum(str(file))}}))
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
    monkeypatch.setenv("TP", "1")
    with pytest.raises(CheckpointError, match="written at TP=2 PP=1; resume with the same TP and PP"):
        prepare(parse_args(["--config", TINY, "--output-dir", str(out), "--resume", "--allow-config-change"]), 1)
    monkeypatch.delenv("TP")
    prepared(out, "--overwrite")
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_a_cpu_linear_kernel_torch_does_not_have_is_refused_before_start_up(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_RLHF_CPU_LINEARS", "mkl")
    with pytest.raises(ValueError, match=r"MEGATRON_RLHF_CPU_LINEARS='mkl': must be one of onednn, torch"):
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
    code = ("from megatron_rlhf.train import parse_args, prepare; "
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
    from megatron_rlhf.train import _peer_problem

    said = "the first 4 reward calls of the batch all timed out; ... took over 3s (reward.timeout_s)"
    assert _peer_problem(RewardFunctionError(said), 1800) is None
    assert _peer_problem(RuntimeError("[gloo] Timed out waiting 1800000ms"), 1800).startswith("a collective waited")


def test_a_rank_gone_without_a_word_is_named_as_such(tmp_path, monkeypatch):
    """kill -9 of a rank (or the OOM killer): the survivor's line names the rank whose process is gone,
    not "its own output says why" (it printed nothing)."""
    import socket

    from megatron_rlhf.train import _ranks_elsewhere

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host, now = socket.gethostname(), time.time()
    (tmp_path / "rank0").write_text(f"3\tppo_policy (training)\t{now:.0f}\t{host}\t{os.getpid()}")
    (tmp_path / "rank1").write_text(f"3\tppo_policy (training)\t{now:.0f}\t{host}\t{ended.pid}")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    said = _ranks_elsewhere(str(tmp_path), 3, "ppo_policy (training)")
    assert said.startswith(f"rank 1 (pid {ended.pid}) ended in iteration 3, ppo_policy (training), without a word: "
                           "killed (the kernel's out-of-memory killer says so in dmesg) or crashed"), said
    (tmp_path / "rank1").write_text(f"3\tppo_policy (training)\t{now:.0f}\t{host}\t{os.getpid()}")
    assert _ranks_elsewhere(str(tmp_path), 3, "ppo_policy (training)").startswith("every rank recorded this phase")


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
