"""The one run loop (run_loop.py) that every stage goes through: what it does for each stage as it
does for RL (free_memory: auto, overlapped onloads, a collective's time-out named by step and
phase), and the checkpoint as a contract (a format version, nothing that runs code on load, the
stage that wrote it)."""

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_rlhf.checkpoint.model_files import CheckpointError, write_manifest
from megatron_rlhf.config import ConfigError
from tests.conftest import REPO, spawn_ranks
from tests.test_faults import fake_checkpoint, prepared

PIPELINE = REPO / "examples" / "tiny_pipeline"


def _computed(rows):
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def test_free_memory_auto_and_overlapped_onloads_change_no_number_in_any_stage(workers):
    """SFT, the reward model and DPO (3 steps, validated), each plain and with every role's
    free_memory: auto and trainer.overlap_onload on: the same metrics bit for bit, the choice
    made at start-up, said and recorded, and DPO's reference onload overlapping the policy's."""
    r = workers(2, "stage_runs")[0]
    for stage in ("sft", "rm", "dpo"):
        plain, auto = r.metrics[f"{stage}:plain"], r.metrics[f"{stage}:auto_overlap"]
        assert len(plain) == 3 and _computed(auto) == _computed(plain), stage
        choice = r.auto_choice[stage]
        assert choice["chosen"] == {role: [] for role in choice["roles"]} and choice["roles"], stage
        assert f"free_memory: auto: {choice['reason']}" in r.printed[f"{stage}:auto_overlap"]
    assert "overlapping reference -> policy" in r.printed["dpo:auto_overlap"]
    assert "val/loss" in r.metrics["dpo:plain"][-1] and "val/loss" in r.metrics["rm:plain"][-1]  # the last step validated


@pytest.mark.parametrize("stage, phase", [("sft", "policy (training)"), ("rm", "reward (training)"),
                                          ("dpo", "policy (training)")])
def test_a_rank_that_does_not_arrive_ends_any_stage_with_a_line_naming_the_step_and_phase(tmp_path, stage, phase):
    config = tmp_path / f"{stage}.yaml"
    config.write_text(f"includes: {PIPELINE / (stage + '.yaml')}\ntrainer:\n  collective_timeout_s: 3\n")
    command = [sys.executable, str(REPO / "tests" / "helpers" / "stalled_rank.py"), "2", "--", "--config", str(config),
               "--output-dir", str(tmp_path / "out"), "--iterations", "3"]
    started = time.monotonic()
    ranks = spawn_ranks(command, 2, {**os.environ, "OMP_NUM_THREADS": "1", "PROGRESS_BAR": "False",
                                     "TENSORBOARD": "False"}, 120, tmp_path)
    output = "\n".join(text for _, text in ranks)
    assert any(code != 0 for code, _ in ranks) and time.monotonic() - started < 50
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith(f"error: (rank 0) step 2, {phase}: a collective waited longer than "
                                "trainer.collective_timeout_s=3s: another rank did not arrive"), errors[0]
    assert "elsewhere: rank 1 in step 2, stalled by the test for " in errors[0]  # the rank that did not arrive


class _Payload:
    """What an attacker pickles into a checkpoint: its loading would create ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def test_a_trainer_state_holding_a_pickled_callable_is_refused_at_resume_without_running_it(tmp_path):
    """A payload added to a run's trainer_state.pt with the manifest written again (as anyone who
    can write the directory can): --resume refuses the checkpoint by name, the payload never runs."""
    out, marker = tmp_path / "out", tmp_path / "ran"
    config = prepared(out).config
    path = fake_checkpoint(out, "iter_0000004", config)
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    torch.save({**state, "steps": {"note": _Payload(marker)}}, path / "trainer_state.pt")
    (path / "manifest.json").unlink()
    write_manifest(str(path))
    with pytest.raises(CheckpointError, match=r"trainer_state.pt: holds objects other than tensors and plain types, "
                                              r"refused without loading them"):
        prepared(out, "--resume")
    assert not marker.exists()
    torch.load(path / "trainer_state.pt", weights_only=False)  # loaded as pickle, it runs: the payload is real
    assert marker.exists()


def test_a_checkpoint_of_an_unknown_or_newer_format_or_another_stage_is_refused_by_name(tmp_path):
    import json

    out = tmp_path / "out"
    config = prepared(out).config
    path = fake_checkpoint(out, "iter_0000004", config)
    manifest = json.loads((path / "manifest.json").read_text())
    for version, said in ((3, r"checkpoint format version 3 is newer than this megatron-rlhf reads \(2\)"),
                          ("2", r"format 'megatron-rlhf' version '2' is not a megatron-rlhf checkpoint format")):
        (path / "manifest.json").write_text(json.dumps({**manifest, "version": version}))
        with pytest.raises(CheckpointError, match=said):
            prepared(out, "--resume")
    # Format 1 (before the format had a version: the files at the manifest's top level).
    (path / "manifest.json").write_text(json.dumps(manifest["files"]))
    with pytest.raises(CheckpointError, match=r"a run checkpoint of format 1, written by an earlier megatron-rlhf; this "
                                              r"version resumes format 2 only"):
        prepared(out, "--resume")
    # A checkpoint of another stage (an SFT run's, resumed with the RL config).
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    torch.save({**state, "stage": "sft"}, path / "trainer_state.pt")
    (path / "manifest.json").unlink()
    write_manifest(str(path))
    with pytest.raises(ConfigError, match=r"is a checkpoint of stage sft, and this run is stage rl"):
        prepared(out, "--resume")
