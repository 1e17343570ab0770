"""The cluster launch: linted scripts, run_ppo.sh's input checks, the dry run's figures against
closed-form formulas, and a real single-node Slurm running run_ppo.sbatch."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN_PPO = REPO / "examples" / "llama2" / "run_ppo.sh"
SBATCH = REPO / "examples" / "llama2" / "slurm" / "run_ppo.sbatch"
GIB = 2**30
LAUNCH_VARS = ("TP", "PP", "NNODES", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
               "ROLLOUT_BATCH_SIZE", "ITERATIONS", "OUTPUT_DIR", "PROMPT_FILE", "KL_COEF", "MAX_NEW_TOKENS",
               "PYTORCH_CUDA_ALLOC_CONF")


def _tool(name: str) -> str:
    """A linter installed by the test extras (next to this interpreter), else on PATH."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is not installed: `pip install -e .[test]` installs it"
    return found


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(("free_memory_", "SLURM_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def _shell_scripts():
    return sorted(REPO.glob("examples/**/*.sh")) + sorted(REPO.glob("examples/**/*.sbatch")) + \
        sorted(REPO.glob("tests/*.sh")) + sorted(REPO.glob("bench/**/*.sh")) + [REPO / ".ci" / "run"]


def test_shell_scripts_pass_shellcheck(tmp_path):
    scripts = _shell_scripts()
    assert RUN_PPO in scripts and SBATCH in scripts
    result = subprocess.run([_tool("shellcheck"), "--shell=bash", *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # The linter really lints: an unquoted expansion is reported.
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\necho $1\n")
    assert subprocess.run([_tool("shellcheck"), str(bad)], capture_output=True).returncode != 0


def test_dockerfile_passes_hadolint(tmp_path):
    result = subprocess.run([_tool("hadolint"), str(REPO / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    assert subprocess.run([_tool("hadolint"), str(bad)], capture_output=True).returncode != 0


def _run_ppo(tmp_path, **env):
    return subprocess.run(["bash", str(RUN_PPO)], cwd=tmp_path, env=_env(**env), capture_output=True, text=True, timeout=60)


def test_run_ppo_refuses_bad_inputs_before_launching(tmp_path):
    # Every rule comes from megatron_rlhf.launch and the config's validation, naming the variables.
    bad = _run_ppo(tmp_path, MODEL_SIZE="70b", TP="16", PP="3", ROLLOUT_BATCH_SIZE="100", free_memory_value="maybe",
                   POLICY_LOAD="no/such/ckpt", PROMPT_FILE="prompts.jsonl")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    err = bad.stderr
    for expected in (
        "value.free_memory (environment variable free_memory_value=maybe): expected bool",
        "(environment variable TP=16): world size 32 is not divisible by TP*PP = 16*3 = 48",
        "(environment variable TP=16): 16 does not divide policy, reference, reward, value, ppo_policy, ppo_value's "
        "num_query_groups=8",
        "(environment variable PP=3): 3 does not divide policy, reference, reward, value, ppo_policy, ppo_value's "
        "num_layers=80",
        "NNODES=4: a multi-node launch needs MASTER_ADDR",
        f"(environment variable POLICY_LOAD={tmp_path}/no/such/ckpt): {tmp_path}/no/such/ckpt: no such file or directory",
        "REWARD_LOAD is not set",
        "data.tokenizer.path (environment variable TOKENIZER, not set): tokenizer type 'hf' needs a Hugging Face model directory",
        f"(environment variable PROMPT_FILE={tmp_path}/prompts.jsonl): {tmp_path}/prompts.jsonl: no such file",
        "run_ppo.sh: nothing was launched",
    ):
        assert expected in err, f"missing {expected!r} in:\n{err}"
    assert "Traceback" not in err

    # Sizes that do not divide the data-parallel layout.
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    batches = _run_ppo(tmp_path, MODEL_SIZE="tiny", GPUS_PER_NODE="4", TP="2", ROLLOUT_BATCH_SIZE="12",
                       TRAIN_GLOBAL_BATCH_SIZE="6", TRAIN_MICRO_BATCH_SIZE="2", PROMPT_FILE="prompts.jsonl")
    assert batches.returncode == 2
    assert "(environment variable TRAIN_GLOBAL_BATCH_SIZE=6): 6 is not divisible by micro_batch_size*DP = 2*2" \
        in batches.stderr, batches.stderr
    assert "(environment variable INFERENCE_MICRO_BATCH_SIZE=4): 4 does not divide the per-rank rollout of 6" \
        in batches.stderr, batches.stderr

    unknown = _run_ppo(tmp_path, MODEL_SIZE="65b")
    assert unknown.returncode == 2 and "MODEL_SIZE=65b: expected one of tiny, 7b, 13b, 70b" in unknown.stderr

    ok = _run_ppo(tmp_path, MODEL_SIZE="tiny", PROMPT_FILE="prompts.jsonl", CHECK_ONLY="1")
    assert ok.returncode == 0 and "inputs checked: tiny, 2 GPUs (TP=2 PP=1 DP=1)" in ok.stdout, ok.stderr
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in ok.stdout  # set unless the user set it
    mine = _run_ppo(tmp_path, MODEL_SIZE="tiny", PROMPT_FILE="prompts.jsonl", CHECK_ONLY="1",
                    PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512")
    assert "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512" in mine.stdout, mine.stderr
    # CHECK_ONLY reads the inputs as the run would (the first rendered prompt shown), writing nothing;
    # a row without a prompt is found there, not at start-up.
    assert "first prompt (" in ok.stdout and not (tmp_path / "outputs").exists()
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"question": "hi"}\n')
    bad = _run_ppo(tmp_path, MODEL_SIZE="tiny", PROMPT_FILE="bad.jsonl", CHECK_ONLY="1")
    assert bad.returncode == 2 and "bad.jsonl:2: no 'prompt' (a string) or 'messages'" in bad.stderr, bad.stderr
    assert "run_ppo.sh: nothing was launched" in bad.stderr and "Traceback" not in bad.stderr


def test_every_variable_that_names_a_path_is_made_absolute_from_where_the_launch_runs():
    import re

    from megatron_rlhf.launch import PATH_VARIABLES

    path_keys = ("load", "load_lora", "path", "prompt_file", "train_file", "val_file", "output_dir")
    found = set()
    for recipe in (REPO / "examples").glob("*/*.yaml"):
        found |= set(re.findall(r"\b(?:%s): \$\{([A-Z_]+)" % "|".join(path_keys), recipe.read_text()))
    assert found and found <= set(PATH_VARIABLES), sorted(found - set(PATH_VARIABLES))


def test_run_ppo_finds_the_repository_venv_and_says_when_the_package_is_missing(tmp_path):
    missing = _run_ppo(tmp_path, PYTHON="false", MODEL_SIZE="tiny")
    assert missing.returncode == 2
    assert "PYTHON=false cannot import megatron_rlhf and torch; run 'make install'" in missing.stderr
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv in the repository (make install creates it)")
    # As after `make demo`: nothing activated, no PYTHON, a PATH without the venv.
    env = {k: v for k, v in _env().items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"
    plan = subprocess.run(["bash", str(RUN_PPO)], cwd=tmp_path, env=dict(env, DRY_RUN="1", MODEL_SIZE="tiny"),
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert "dry run: nothing was launched" in plan.stdout


def _llama2_70b_numels(tp: int, pp: int):
    """Parameters of Llama-2-70B's most loaded pipeline stage on one TP rank, from the architecture
    (h 8192, 80 layers, 64 heads of 128, 8 KV heads, FFN 28672, vocabulary 32000 padded to a
    multiple of 128*TP), for the LM head and the scalar (reward/value) head."""
    h, layers, heads, kv, head_dim, ffn = 8192, 80, 64, 8, 128, 28672
    vocab = -(-32000 // (128 * tp)) * (128 * tp)
    layer = (2 * h  # two RMSNorms, replicated on every TP rank
             + h * (heads + 2 * kv) * head_dim // tp  # fused QKV
             + heads * head_dim * h // tp  # attention output
             + 2 * ffn * h // tp + ffn * h // tp)  # SwiGLU gate+up, down
    body = layer * layers // pp
    first = body + vocab * h // tp  # embedding
    last = {"lm": body + h + vocab * h // tp, "scalar": body + h + h}  # final norm, output layer / score head
    return {head: max(first, last[head]) for head in ("lm", "scalar")}


def _table(text: str):
    """The per-role memory table of the dry run: role -> kind -> bytes."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("role") and "weights" in line and "grads" in line)
    kinds = lines[start].split()[1:]
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    table = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        role, *cells = line.split()
        values = [float(v) * units[u] for v, u in zip(cells[::2], cells[1::2])]
        table[role] = dict(zip(kinds, values))
    return table


def test_dry_run_of_llama2_70b_on_4_nodes_of_8_gpus_matches_the_formulas(tmp_path):
    result = subprocess.run(["bash", str(RUN_PPO)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=_env(DRY_RUN="1", MODEL_SIZE="70b", NNODES="4", GPUS_PER_NODE="8"))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "32 processes = 4 node(s) x 8; TP=8 PP=2 DP=2" in out and "each within one node" in out
    assert "preset: llama2-70b" in out  # the resolved config
    assert "(a real launch stops here)" in result.stderr and "POLICY_LOAD is not set" in result.stderr
    assert "UserWarning" not in result.stderr  # megatron-core's fallback warnings (no TE, no Apex) hidden
    table = _table(out)
    assert set(table) == {"policy", "reference", "reward", "value", "ppo_policy", "ppo_value"}
    n = _llama2_70b_numels(tp=8, pp=2)
    dp = 2

    def close(got, expected, what):
        # The table prints 2 decimals of GiB; megatron's buffer padding adds < 0.01%.
        assert abs(got - expected) <= 0.005 * expected + 0.006 * GIB, f"{what}: table {got / GIB:.3f} GiB, formula {expected / GIB:.3f} GiB"

    for role, head in (("ppo_policy", "lm"), ("ppo_value", "scalar")):
        row = table[role]
        close(row["weights"], 2 * n[head], f"{role} weights (bf16)")
        close(row["grads"], 4 * n[head], f"{role} grads (fp32 grad buffer)")
        close(row["main_params"], 4 * n[head] / dp, f"{role} fp32 main params, sharded over DP={dp}")
        close(row["optimizer_state"], 8 * n[head] / dp, f"{role} Adam exp_avg + exp_avg_sq, sharded over DP={dp}")
    close(table["reference"]["weights"], 2 * n["lm"], "reference weights")
    close(table["reward"]["weights"], 2 * n["scalar"], "reward weights")
    # policy and value serve ppo_policy's and ppo_value's weights: none of their own.
    assert table["policy"]["weights"] == 0 and table["value"]["weights"] == 0
    assert table["policy"]["kv_cache"] > 0 and "<- peak" in out and "fits in 80.00 GiB" in out
    # A checkpoint save: every rank writes its own 1/DP of its slice's optimizer state (fp32 main
    # params and both moments, 12 bytes a parameter), DP rank 0 also the slice's weights (bf16), a
    # role at a time; every rank of node 0 is DP rank 0 of its TP group (TP fastest, then DP, then PP).
    line = next(line for line in out.splitlines() if line.startswith("checkpoint save"))
    per_rank = float(re.search(r"gathered\): ([\d.]+) GiB per rank", line).group(1)) * GIB
    first = float(re.search(r"per rank, ([\d.]+) GiB on DP rank 0", line).group(1)) * GIB
    peak = float(re.search(r"\(peak ([\d.]+) GiB\)", line).group(1)) * GIB
    close(per_rank, 12 * (n["lm"] + n["scalar"]) / dp, "optimizer state every rank writes (1/DP)")
    close(first, (2 + 12 / dp) * (n["lm"] + n["scalar"]), "what DP rank 0 writes (weights too)")
    close(peak, (2 + 12 / dp) * n["lm"], "DP rank 0's host peak (ppo_policy's share)")
    assert "on the busiest node of 8 ranks (8 DP rank 0)" in line


def test_dry_run_of_llama31_8b_on_8_gpus_says_each_ranks_checkpoint_share(tmp_path):
    """The launcher's Llama-3.1-8B preset (TP=2, DP=4 on one node of 8): every rank writes 1/4 of
    its slice's optimizer state, DP rank 0 of each TP slice also the slice's weights, nothing
    gathered; the node holds two DP rank 0 (ranks 0 and 1)."""
    result = subprocess.run(["bash", str(RUN_PPO)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=_env(DRY_RUN="1", MODEL_SIZE="llama3.1-8b", NNODES="1", GPUS_PER_NODE="8"))
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("checkpoint save"))
    per_rank = float(re.search(r"gathered\): ([\d.]+) GiB per rank", line).group(1))
    first = float(re.search(r"per rank, ([\d.]+) GiB on DP rank 0", line).group(1))
    weights = [float(w) for w in re.findall(r"weights ([\d.]+) GiB", line)]
    states = [float(o) for o in re.findall(r"optimizer state ([\d.]+) GiB", line)]
    assert len(weights) == len(states) == 2  # ppo_policy and ppo_value
    assert abs(first - (sum(weights) + per_rank)) <= 0.02  # DP rank 0: its share of the state plus the weights
    assert abs(sum(states) - per_rank) <= 0.02 and abs(states[0] - 6 * weights[0] / 4) <= 0.02  # 12 B / 2 B / DP=4
    assert "(2 DP rank 0)" in line and "one role at a time in host memory" in line
    assert (per_rank, first) == (21.70, 36.17)  # as docs/guide/checkpoints.md quotes it


def test_a_checkpoint_save_that_would_not_fit_the_host_is_refused_before_start_up(monkeypatch):
    import types

    import psutil

    from megatron_rlhf.config import ConfigError, load_config
    from megatron_rlhf.memory.planner import checkpoint_plan, plan
    from megatron_rlhf.startup import check_host_memory

    config = load_config(str(REPO / "examples" / "tiny" / "rlhf.yaml"), world_size=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    arenas, saving = plan(config, 2).host_bytes * 2, checkpoint_plan(config, 2, 2).node_bytes
    assert saving > 0 and checkpoint_plan(config, 2, 2).writers_per_node == 2  # TP=2, DP=1: each TP rank is DP rank 0
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=arenas + saving - 1))
    with pytest.raises(ConfigError, match=r"a checkpoint save would hold .* of host memory on this node .* more than "
                                          r"the .* available: checkpoint save \(every rank writes"):
        check_host_memory(config, 2)
    # Background saves hold every trained role's copy until written: the sum of the roles, not the largest.
    config.trainer.async_save = True
    background = checkpoint_plan(config, 2, 2)
    per_role = [sum(kinds.values()) for kinds in background.writer.values()]
    assert len(per_role) == 2 and background.writer_peak == sum(per_role) > max(per_role)
    assert background.node_bytes > saving
    with pytest.raises(ConfigError, match=r"every role's copy in host memory until the background writer is done"):
        monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=arenas + saving + 1))
        check_host_memory(config, 2)  # enough for a save at once, not for a background one
    config.trainer.save_at_end, config.trainer.save_interval = False, 0
    check_host_memory(config, 2)  # no checkpoint: the arenas fit


def test_model_size_auto_plans_the_converted_checkpoints_own_architecture_and_layout(tmp_path):
    import torch

    from megatron_rlhf.checkpoint.model_files import write_model_meta
    from megatron_rlhf.config.presets import PRESETS
    from megatron_rlhf.config.schema import ModelArchConfig

    # A Qwen2.5-0.5B-shaped checkpoint (no preset of that size), converted at TP=2.
    arch = ModelArchConfig(**{**PRESETS["qwen2.5-7b"], "num_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
                              "num_query_groups": 2, "ffn_hidden_size": 4864, "vocab_size": 151936,
                              "tie_word_embeddings": True})
    (tmp_path / "qwen-small").mkdir()
    write_model_meta(str(tmp_path / "qwen-small"), arch, "lm", torch.bfloat16, 2, 1)
    plan = subprocess.run(["bash", str(RUN_PPO)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=_env(DRY_RUN="1", MODEL_SIZE="auto", POLICY_LOAD="qwen-small", GPUS_PER_NODE="2",
                                   CONFIG=str(REPO / "examples" / "qwen2.5" / "grpo_gsm8k.yaml"), VAL_INTERVAL="0",
                                   VAL_BEFORE_TRAIN="false"))
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "2 processes = 1 node(s) x 2; TP=2 PP=1 DP=1" in plan.stdout  # the checkpoint's own TP
    assert re.search(r"^ppo_policy +qwen2-h896x24 +494\.03M +lm", plan.stdout, re.M)  # Qwen2.5-0.5B's 494M parameters
    assert f"output_dir: {tmp_path}/outputs/qwen-small-grpo_gsm8k" in plan.stdout


def test_train_dry_run_resolves_the_environment_and_checks_the_layout(tmp_path):
    def dry(*args, **env):
        return subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--config", "examples/llama2/rlhf.yaml",
                               "--dry-run", *args], cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=120)

    ok = dry("--world-size", "16", "--nproc-per-node", "8", KL_COEF="0.123", TP="8", PP="1")
    assert ok.returncode == 0, ok.stderr
    assert "kl_coef: 0.123" in ok.stdout and "16 processes = 2 node(s) x 8; TP=8 PP=1 DP=2" in ok.stdout
    assert "# not found on this machine" in ok.stdout and "data.prompt_file (environment variable PROMPT_FILE, not set): no prompt file given" in ok.stdout
    assert "dry run: nothing was launched" in ok.stdout
    bad = dry("--world-size", "16", TP="3")
    assert bad.returncode == 2
    assert "parallel.tensor_model_parallel_size" in bad.stderr and "valid TP" in bad.stderr
    too_small = dry("--world-size", "8", "--gpu-memory", "10GiB", TP="8")
    assert too_small.returncode == 1 and "does not fit in 10.00 GiB" in too_small.stdout
    misuse = subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--config", "examples/tiny/rlhf.yaml",
                             "--world-size", "2"], cwd=REPO, env=_env(), capture_output=True, text=True)
    assert misuse.returncode == 2 and "--world-size goes with --dry-run or --check-only" in misuse.stderr


def test_rank_groups_are_megatrons_numbering():
    """rank = tp_rank + TP * (dp_rank + DP * pp_rank), and within a DP group the EP ranks are
    consecutive (dp_rank = ep_rank + EP * edp_rank): worked out by hand for two layouts."""
    from megatron_rlhf.dry_run import rank_groups

    groups = rank_groups(2, 2, 2)
    assert groups == {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                      "pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "cp": [[r] for r in range(8)]}
    groups = rank_groups(1, 2, 4, ep=2)
    assert groups["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and groups["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.fixture
def slurm(tmp_path):
    from tests.helpers.slurm_cluster import LocalSlurm, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(tmp_path / "slurm")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def test_sbatch_on_a_single_node_slurm_runs_ppo(slurm, tmp_path):
    from tests.conftest import _free_port

    out = tmp_path / "run"
    env = _env(**{k: v for k, v in slurm.env.items() if k == "SLURM_CONF"},
               MODEL_SIZE="tiny", GPUS_PER_NODE="2", ITERATIONS="2", OUTPUT_DIR=str(out), MASTER_PORT=str(_free_port()))
    # --gpus-per-node=0: this cluster has CPUs only (the script asks for 8 GPUs per node).
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0",
                          f"--output={tmp_path}/job-%j.out", str(SBATCH)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, f"sbatch: {job.stdout}{job.stderr}\n{slurm.logs()}"
    state = slurm.wait_for_job(job.stdout.strip().split(";")[0], timeout=600)  # not sbatch --wait: it polls slowly
    log = "\n".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert state == ("COMPLETED", "0:0"), f"job {state}; output:\n{log}\n{slurm.logs()}"
    assert "inputs checked: tiny, 2 GPUs (TP=2 PP=1 DP=1)" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert re.search(r"done: 2 iterations", log)


def test_a_failed_launch_ends_with_the_runs_own_error_line(tmp_path):
    from tests.conftest import _free_port

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"iteration": 1}\n')  # an earlier run: this launch must not mix into it
    failed = _run_ppo(tmp_path, MODEL_SIZE="tiny", GPUS_PER_NODE="2", ITERATIONS="2", OUTPUT_DIR=str(out),
                      MASTER_PORT=str(_free_port()))
    assert failed.returncode == 2
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "already holds a run" in lines[-1], failed.stderr[-3000:]
    assert [line for line in lines if "error:" in line] == [lines[-1]] and "Traceback" not in failed.stderr


def test_ctrl_c_under_the_launcher_is_one_line_and_status_130(tmp_path):
    import signal
    import time

    from tests.conftest import _free_port

    out = tmp_path / "run"
    launch = subprocess.Popen(["bash", str(RUN_PPO)], cwd=tmp_path, env=_env(
        MODEL_SIZE="tiny", GPUS_PER_NODE="2", ITERATIONS="40", OUTPUT_DIR=str(out), MASTER_PORT=str(_free_port())),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert time.monotonic() < deadline and launch.poll() is None, "the run did not reach iteration 1"
            time.sleep(0.2)
        os.killpg(launch.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole foreground group
        _, err = launch.communicate(timeout=60)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
    assert launch.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("run_ppo.sh: interrupted (Ctrl-C); the last checkpoint is kept"), err[-3000:]
    assert "Traceback" not in err and err.count("interrupted (Ctrl-C)") == 1, err[-3000:]  # one line, nothing else


def test_run_ppo_launches_the_stages_before_rl_by_stage(tmp_path):
    """STAGE picks the recipe (examples/llama2/{sft,rm,prm,dpo}.yaml), its inputs checked like RL's and
    planned by the dry run; a wrong STAGE, or one its CONFIG does not run, is refused by name (the
    stages themselves run in tests/test_preference_stages.py)."""
    pipeline = REPO / "examples" / "tiny_pipeline"
    checked = _run_ppo(tmp_path, STAGE="dpo", MODEL_SIZE="tiny", TRAIN_FILE=str(pipeline / "pairs.jsonl"),
                       CHECK_ONLY="1")
    assert checked.returncode == 0 and "inputs checked for 2 processes: 384 pairs" in checked.stdout, checked.stderr
    planned = _run_ppo(tmp_path, STAGE="prm", MODEL_SIZE="7b", DRY_RUN="1")
    assert planned.returncode == 0, planned.stderr
    assert "stage: prm, roles: reward (reward trained)" in planned.stdout and "REWARD_LOAD is not set" in planned.stderr
    unknown = _run_ppo(tmp_path, STAGE="ppo", MODEL_SIZE="tiny")
    assert unknown.returncode == 2 and "STAGE=ppo: expected one of rl, sft, rm, prm, dpo" in unknown.stderr
    mismatch = _run_ppo(tmp_path, STAGE="dpo", MODEL_SIZE="tiny", CONFIG=str(REPO / "examples" / "llama2" / "rm.yaml"),
                        TRAIN_FILE=str(pipeline / "pairs.jsonl"), CHECK_ONLY="1")
    assert mismatch.returncode == 2 and "runs stage: rm; set CONFIG to a recipe of stage dpo" in mismatch.stderr


# -- The demos own their output ---------------------------------------------------------------------

@pytest.mark.parametrize("target, config, directory", [("demo", "examples/tiny/rlhf.yaml", "demo"),
                                                       ("demo-math", "examples/tiny_math/grpo.yaml", "demo-math")])
def test_a_demo_reads_nothing_the_shell_exports_and_writes_only_its_own_directory(tmp_path, target, config, directory):
    """`make demo` after `export OUTPUT_DIR=$PWD/runs/grpo POLICY_LOAD=... ITERATIONS=...` (a real
    run's set-up, the README's): the demo's launch sees none of them and writes to its own
    directory (the launch recorded by a stand-in torchrun)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").touch()
    torchrun = venv / "bin" / "torchrun"
    torchrun.write_text(f"#!/bin/sh\nenv > {tmp_path}/launch.env\necho \"$@\" > {tmp_path}/launch.args\n")
    torchrun.chmod(0o755)
    exported = {"OUTPUT_DIR": str(tmp_path / "runs" / "grpo"), "POLICY_LOAD": str(tmp_path / "ckpt"), "ITERATIONS": "7",
                "TP": "4", "PROMPT_FILE": str(tmp_path / "mine.jsonl")}
    made = subprocess.run(["make", "-o", "examples/tiny/prompts.jsonl", "-o", "examples/tiny_math/train.jsonl",
                           f"VENV={venv}", f"DEMO_OUTPUTS={tmp_path / 'demos'}", target],
                          cwd=REPO, env={**os.environ, **exported}, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    seen = dict(line.split("=", 1) for line in (tmp_path / "launch.env").read_text().splitlines() if "=" in line)
    assert not set(exported) & set(seen), "the demo's launch saw the shell's variables"
    assert (tmp_path / "launch.args").read_text().split() == [
        "--nproc_per_node=2", "-m", "megatron_rlhf.train", "--overwrite", "--config", config,
        "--output-dir", f"{tmp_path / 'demos'}/{directory}"]


def test_overwrite_replaces_only_a_run_of_the_same_config_file(tmp_path):
    """--overwrite of a directory that holds another config's run (or one that records none) is
    refused by name before anything is removed; a run of the same config file is replaced."""
    from megatron_rlhf.config import ConfigError
    from megatron_rlhf.startup import prepare
    from megatron_rlhf.train import parse_args

    def launch(config, *flags):
        return prepare(parse_args(["--config", str(REPO / config), "--output-dir", str(tmp_path / "out"), *flags]), 2)

    launch("examples/tiny/grpo.yaml")  # a run of grpo.yaml starts here (run.json)
    (tmp_path / "out" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    with pytest.raises(ConfigError, match=rf"out holds a run of {REPO}/examples/tiny/grpo.yaml \(stage rl\); --overwrite "
                                          r"replaces only a run of this config file \(.*rlhf.yaml\), nothing was removed"):
        launch("examples/tiny/rlhf.yaml", "--overwrite")
    assert (tmp_path / "out" / "metrics.jsonl").exists()
    from megatron_rlhf.checkpoint.run_state import drop_set_aside

    launch("examples/tiny/grpo.yaml", "--overwrite")  # the same config: replaced
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    drop_set_aside(str(tmp_path / "out"))  # as the new run's first iteration does
    (tmp_path / "out" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    (tmp_path / "out" / "run.json").unlink()
    with pytest.raises(ConfigError, match=r"holds a run \(metrics.jsonl\) that records no config file"):
        launch("examples/tiny/grpo.yaml", "--overwrite")


def test_the_launcher_sets_only_what_a_launch_needs_and_a_recipe_keeps_its_own_defaults(monkeypatch):
    """MODEL_SIZE's defaults are the launch's (nodes, GPUs, parallel sizes, end token), never a
    recipe's: the GSM8K recipe's 1024 new tokens and 512 prompt tokens stay as it says."""
    from megatron_rlhf.config.loader import read_config
    from megatron_rlhf.launch import LAUNCH_PRESETS, resolve_environment

    recipe_variables = {"MAX_NEW_TOKENS", "MAX_PROMPT_LENGTH", "ROLLOUT_BATCH_SIZE", "TRAIN_GLOBAL_BATCH_SIZE",
                        "GENERATION_BATCH_SIZE", "ITERATIONS", "PRECISION", "TOKENIZER_TYPE"}
    for size in set(LAUNCH_PRESETS) - {"tiny"}:  # tiny's are its model's (its 256 positions)
        env = {"MODEL_SIZE": size}
        assert resolve_environment(env, str(REPO / "examples" / "qwen2.5"), str(REPO)) == []
        assert not recipe_variables & set(env), (size, recipe_variables & set(env))
    env = {"MODEL_SIZE": "qwen2.5-7b"}
    resolve_environment(env, str(REPO / "examples" / "qwen2.5"), str(REPO))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config, _ = read_config(str(REPO / "examples" / "qwen2.5" / "grpo_gsm8k.yaml"))
    assert (config.generation.max_new_tokens, config.data.max_prompt_length) == (1024, 512)


def test_a_run_that_fails_under_the_launcher_ends_with_one_error_line_and_status_2(tmp_path):
    """A fault after start-up (a learning rate that makes the loss non-finite, given as a key=value
    after --): the rank's one error: line is the run's last word, without torchrun's report of the
    failed ranks (its ChildFailedError traceback and table), and the status is 2."""
    env = _env(MODEL_SIZE="tiny", ITERATIONS="2", OUTPUT_DIR=str(tmp_path / "out"))
    failed = subprocess.run(["bash", str(RUN_PPO), "--overwrite", "ppo_policy.lr=1e30"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=240)
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]], failed.stderr[-3000:]
    assert lines[-1].startswith("error: iteration 1, optimizer step ") and "ppo_policy.lr=1e+30" in lines[-1]
    assert "Traceback" not in failed.stderr and "ChildFailedError" not in failed.stderr
