"""PPO save and resume: identical continuation, resume at another DP, TP or PP, each rank writing
its own part of the optimizer state, crash-safe saves."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_rlhf.checkpoint.run_checkpoint import intact_checkpoints
from tests.conftest import REPO, _free_port
from tests.test_train import metrics, train, without_times


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """Four iterations of the tiny demo uninterrupted, a checkpoint after each (written at once)."""
    out = tmp_path_factory.mktemp("whole")
    config = out / "every_iteration.yaml"
    config.write_text(f"includes: {REPO / 'examples' / 'tiny' / 'rlhf.yaml'}\ntrainer:\n  save_interval: 1\n")
    train(out / "run", "--iterations", "4", config=config)
    return out / "run"


def _checkpoint_files(run, name):
    """Each file of checkpoint ``name`` with its size and CRC-32 (the manifest), but the trainer
    state's (it names the run)."""
    manifest = json.loads((run / "checkpoints" / name / "manifest.json").read_text())["files"]
    return {f: v for f, v in manifest.items() if f != "trainer_state.pt"}


def test_background_saves_write_what_saves_at_once_do_and_a_run_killed_while_writing_resumes_exactly(tmp_path, whole):
    config = tmp_path / "async.yaml"
    config.write_text(f"includes: {REPO / 'examples' / 'tiny' / 'rlhf.yaml'}\n"
                      "trainer:\n  save_interval: 1\n  async_save: true\n")
    # Written in the background while training goes on: the same metrics and the same bytes.
    train(tmp_path / "async", "--iterations", "4", config=config)
    assert without_times(metrics(tmp_path / "async")) == without_times(metrics(whole))
    for name in ("iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004"):
        assert _checkpoint_files(tmp_path / "async", name) == _checkpoint_files(whole, name), name
    assert (tmp_path / "async" / "checkpoints" / "latest").read_text() == "iter_0000004"
    # kill -9 while the third checkpoint is in flight: latest stays on the second, which verifies,
    # and the run resumed from it continues as the uninterrupted one.
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
               "-m", "megatron_rlhf.train", "--config", str(config), "--output-dir", str(killed), "--iterations", "4"]
    proc = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not glob.glob(str(killed / "checkpoints" / ".iter_0000003.tmp-*")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoints" / "latest").read_text() == "iter_0000002"
    assert intact_checkpoints(str(killed), checksums=True)[0].endswith("iter_0000002")
    resumed = train(killed, "--iterations", "4", "--resume", config=config)
    assert "removed .iter_0000003.tmp-" in resumed.stdout
    assert "resumed from" in resumed.stdout and "iter_0000002" in resumed.stdout
    rows = metrics(killed)  # cut back to the checkpoint's iteration, then continued: no iteration twice
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert without_times(rows) == without_times(metrics(whole))
    assert (killed / "checkpoints" / "latest").read_text() == "iter_0000004"
    assert not glob.glob(str(killed / "checkpoints" / ".iter_*"))


def test_resume_at_another_data_tensor_or_pipeline_layout_continues_as_at_its_own(tmp_path):
    import shutil

    # Two iterations at TP=1 x DP=2, each rank writing its half of the optimizer state; then the
    # same checkpoint resumed at its own layout, at TP=2 and at PP=2. The optimizer state is cut as
    # its weights are, and an iteration does not depend on the layout (fp32): the three agree.
    train(tmp_path / "own", "--iterations", "2", env={"TP": "1"})
    checkpoint = tmp_path / "own" / "checkpoints" / "iter_0000002"
    optim = checkpoint / "ppo_policy" / "optim"
    shards = sorted(p.name for p in optim.glob("state_*.pt"))
    assert shards == ["state_t00_p000_e000_d00000.pt", "state_t00_p000_e000_d00001.pt"]  # one per rank, no gather
    sizes = [(optim / name).stat().st_size for name in shards]
    assert max(sizes) < 0.6 * sum(sizes)  # each DP rank wrote about half
    for name in ("tp2", "pp2", "dp1"):
        shutil.copytree(tmp_path / "own", tmp_path / name)
    # At another DP alone (DP=2 -> 1, one process), the run's own config: 3 iterations of 4 steps each.
    train(tmp_path / "dp1", "--iterations", "3", "--resume", nprocs=1, env={"TP": "1"})
    rows = metrics(tmp_path / "dp1")
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[2]["kl/mean"] != 0.0  # trained weights came back (the reference is the initial policy)
    common = torch.load(tmp_path / "dp1" / "checkpoints" / "iter_0000003" / "ppo_policy" / "optim" / "mp_rank_00_000.pt",
                        weights_only=False)
    assert {g["step"] for g in common["optimizer"]["param_groups"]} == {12.0}  # 32 prompts in steps of 8, x 3
    meta = json.loads((tmp_path / "dp1" / "checkpoints" / "iter_0000003" / "ppo_policy" / "megatron_rlhf_model.json")
                      .read_text())
    assert (meta["tp"], meta["pp"]) == (1, 1)
    # With its weights from a checkpoint (the trained policy's, at TP=1: loadable at any layout).
    frozen = tmp_path / "reference"
    shutil.copytree(checkpoint / "ppo_policy", frozen, ignore=shutil.ignore_patterns("optim"))
    config = tmp_path / "rlhf.yaml"
    config.write_text(f"includes: {REPO / 'examples' / 'tiny' / 'rlhf.yaml'}\nreference:\n  load: {frozen}\n")
    for name, env in (("own", {"TP": "1"}), ("tp2", {"TP": "2"}), ("pp2", {"TP": "1", "PP": "2"})):
        train(tmp_path / name, "--iterations", "4", "--resume", "--allow-config-change", env=env, config=config)
    # Iterations 3 and 4: every optimizer step after the first reads the restored Adam moments.
    reference = without_times(metrics(tmp_path / "own")[2:])
    assert [r["iteration"] for r in reference] == [3, 4] and reference[0]["kl/mean"] == 0.0  # the resumed policy
    for name in ("tp2", "pp2"):
        for mine, theirs in zip(metrics(tmp_path / name)[2:], reference):
            for key, value in theirs.items():
                if not key.startswith("weight_sync/"):
                    assert abs(mine[key] - value) <= 1e-5 * max(1.0, abs(value)), (name, key, mine[key], value)


def test_lora_adapters_resume_at_another_tensor_layout_as_at_their_own(tmp_path):
    import shutil

    # The LoRA demo at TP=1 x DP=2, its checkpoint of iteration 2 resumed at TP=2 against the run
    # that went on (a resume at its own layout is that run exactly): a column-parallel linear's B
    # (and a row-parallel one's A) is cut as its weight, the other factor replicated, and so are
    # their Adam moments; the base comes back from the checkpoint (the reference shares it).
    lora = tmp_path / "lora.yaml"
    lora.write_text(f"includes: {REPO / 'examples' / 'tiny' / 'grpo_lora.yaml'}\ntrainer:\n  save_interval: 2\n")
    train(tmp_path / "own", "--iterations", "4", env={"TP": "1"}, config=lora)
    shutil.copytree(tmp_path / "own", tmp_path / "tp2")
    (tmp_path / "tp2" / "checkpoints" / "latest").write_text("iter_0000002")
    train(tmp_path / "tp2", "--iterations", "4", "--resume", "--allow-config-change", env={"TP": "2"}, config=lora)
    at_own, at_tp2 = (without_times(metrics(tmp_path / name))[2:] for name in ("own", "tp2"))
    assert [r["iteration"] for r in at_tp2] == [3, 4]
    for mine, theirs in zip(at_tp2, at_own):
        for key, value in theirs.items():
            if not key.startswith("weight_sync/"):
                assert abs(mine[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, mine[key], value)


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint(workers):
    (r,) = workers(1, "ppo_checkpoint_crash")
    assert r.error.startswith("iteration 2: writing the checkpoint ") and "iter_0000002 failed: disk full (simulated)" \
        in r.error and r.error.endswith(f"the partial checkpoint was removed; the last complete one, {r.first}, is kept")
    # torch.save's RuntimeError for a folder it cannot write ends the same way, not as a traceback.
    assert r.read_only_error.startswith("iteration 2: writing the checkpoint ") and "cannot be opened." in \
        r.read_only_error and "trainer_state.pt)" in r.read_only_error and r.read_only_error.endswith(
            f"the partial checkpoint was removed; the last complete one, {r.first}, is kept")
    assert r.background_error.startswith("iteration 2: writing the checkpoint ") and r.background_error.endswith(
        f"failed: rank 0: disk full (simulated); the partial checkpoint was removed; the last complete one, {r.first}, is kept")
    assert r.latest == r.first and r.latest.endswith("iter_0000001")
    assert r.resumed_iteration == 1
    assert r.listing == ["iter_0000001", "latest"]  # no partial .iter_0000002.tmp-* left filling the disk
    # Every file of a resume is read to the CPU first (a GPU run's tensors never land on one device).
    assert r.map_locations and set(r.map_locations) == {"cpu"}
    # While a background save writes, the writer holds only its own host copies (no role's storage,
    # no EMS host arena, nothing page-locked) and every role stays off the device.
    assert r.writer_holds["tensors"] > 0 and r.writer_holds["bytes"] > 0, r.writer_holds
    assert not r.writer_holds["shares_role_memory"] and not r.writer_holds["pinned"], r.writer_holds
    assert r.resident_while_writing and not any(r.resident_while_writing.values()), r.resident_while_writing
    assert r.held_save.endswith("iter_0000001")  # it completed once let go


def test_dp2_resume_with_reward_normalisation_continues_the_uninterrupted_run(tmp_path):
    # The running reward moments are those of the whole rollout, the same on every DP rank, so
    # the checkpoint (written by rank 0) holds what every rank had.
    # The uninterrupted run's checkpoint of iteration 2, resumed in a copy of its directory.
    import shutil

    env = {"TP": "1", "NORMALIZE_REWARD": "True", "ROLLOUT_BATCH_SIZE": "16"}
    config = tmp_path / "every_other.yaml"
    config.write_text(f"includes: {REPO / 'examples' / 'tiny' / 'rlhf.yaml'}\ntrainer:\n  save_interval: 2\n")
    train(tmp_path / "whole", "--iterations", "3", env=env, config=config)
    shutil.copytree(tmp_path / "whole", tmp_path / "split")
    (tmp_path / "split" / "checkpoints" / "latest").write_text("iter_0000002")
    train(tmp_path / "split", "--iterations", "3", "--resume", env=env, config=config)
    assert [r["iteration"] for r in metrics(tmp_path / "split")] == [1, 2, 3]
    assert without_times(metrics(tmp_path / "split")) == without_times(metrics(tmp_path / "whole"))
