#!/usr/bin/env python3
"""The fault trials of docs/reliability.md, re-run: each fault class is launched as a user would
(the tiny demo under torchrun with 2 processes, run_ppo.sh, the converter, the plan command) in a
scratch directory, and its outcome classified from what the user sees: the exit status, the
number of `error:` lines, whether a Python traceback of the project's code reached the terminal,
and the class's own expectation (a file left intact, a message that names the key, ...).

    python tools/fault_trials.py [--only SUBSTRING] [--markdown]

Outcomes: handled (as expected, one clear line or the documented behaviour), traceback (our
code's traceback shown), wrong (the expectation failed). Takes about 5 minutes on 2 cores.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "tiny" / "rlhf.yaml"
RUN_PPO = REPO / "examples" / "llama2" / "run_ppo.sh"
PY = sys.executable
OWN_FRAMES = f'File "{REPO / "megatron_rlhf"}'


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def train(work: Path, *args, env=None, config=TINY, nproc=2, timeout=180):
    cmd = [PY, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_port()}",
           "-m", "megatron_rlhf.train", "--config", str(config), "--output-dir", str(work / "out"), *args]
    full = dict(os.environ, OMP_NUM_THREADS="1", ITERATIONS="2")
    full.update(env or {})
    return subprocess.run(cmd, cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout)


def include(work: Path, text: str, base=TINY) -> Path:
    path = work / "cfg.yaml"
    path.write_text(f"includes: {base}\n{text}")
    return path


def errors(proc) -> list:
    """Each `error:` report: its line and the indented lines that list its problems."""
    reports, lines = [], proc.stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("error:"):
            block = [line]
            for more in lines[i + 1:]:
                if not more.startswith("  "):
                    break
                block.append(more.strip())
            reports.append(" ".join(block))
    return reports


def one_line(proc, *words) -> bool:
    """Failed with exactly one error report that says every one of ``words``."""
    lines = errors(proc)
    return proc.returncode != 0 and len(lines) == 1 and all(w in lines[0] for w in words)


def finished(proc) -> bool:
    return proc.returncode == 0 and "done: 2 iterations" in proc.stdout


def reward_file(work: Path, body: str) -> str:
    (work / "rw.py").write_text("import os, sys, time\n\n\ndef r(prompts, responses):\n" + body)
    return f"reward:\n  function: {work}/rw.py:r\n  timeout_s: 3\n"


# ---------------------------------------------------------------------------------------------
# The trials: name -> function(work) -> (passed, proc or None)


def t_unknown_key(w):
    p = train(w, config=include(w, "ppo:\n  kl_coeff: 0.1\n"))
    return one_line(p, "ppo.kl_coeff: unknown key; did you mean 'kl_coef'"), p


def t_wrong_type(w):
    p = train(w, env={"ITERATIONS": "abc"})
    return one_line(p, "ITERATIONS=abc", "expected int"), p


def t_missing_config(w):
    p = train(w, config=w / "nope.yaml")
    return one_line(p, "no such config file"), p


def t_yaml_syntax(w):
    (w / "bad.yaml").write_text("ppo: [1, 2\n")
    p = train(w, config=w / "bad.yaml")
    return one_line(p, "not valid YAML"), p


def t_config_not_utf8(w):
    (w / "bad.yaml").write_bytes(b"seed: 1\n# caf\xae\n")
    p = train(w, config=w / "bad.yaml")
    return one_line(p, "bad.yaml:2: not UTF-8 text"), p


def t_tp_not_dividing_heads(w):
    p = train(w, env={"TP": "3"}, nproc=3)
    return one_line(p, "3 does not divide"), p


def t_world_not_divisible(w):
    p = train(w, env={"TP": "4"})
    return one_line(p, "world size 2 is not divisible by TP*PP"), p


def t_negative_kl(w):
    p = train(w, env={"KL_COEF": "-1"})
    return one_line(p, "KL_COEF=-1", "must be >= 0"), p


def t_zero_new_tokens(w):
    p = train(w, env={"MAX_NEW_TOKENS": "0"})
    return one_line(p, "MAX_NEW_TOKENS=0", "must be >= 1") and "overlong" not in p.stderr, p


def t_batch_not_dividing(w):
    p = train(w, env={"ROLLOUT_BATCH_SIZE": "6"})
    return one_line(p, "does not divide the rollout of 6 samples"), p


def t_too_long_sequences(w):
    p = train(w, env={"MAX_NEW_TOKENS": "300"})
    return one_line(p, "exceeds policy's max_position_embeddings=256"), p


def t_missing_prompt_file(w):
    p = train(w, env={"PROMPT_FILE": str(w / "none.jsonl")})
    return one_line(p, "none.jsonl: no such file"), p


def _prompts(w, data: bytes, name="p.jsonl"):
    (w / name).write_bytes(data)
    return {"PROMPT_FILE": str(w / name)}


def t_prompt_bad_json(w):
    p = train(w, env=_prompts(w, b'{"prompt": "ab"}\nnot json\n'))
    return one_line(p, "p.jsonl:2: not valid JSON"), p


def t_prompt_empty(w):
    p = train(w, env=_prompts(w, b'{"prompt": "ab"}\n{"prompt": " "}\n'))
    return one_line(p, "p.jsonl:2: empty 'prompt'"), p


def t_prompt_not_utf8(w):
    p = train(w, env=_prompts(w, b'{"prompt": "ab"}\n{"prompt": "caf\xae"}\n'))
    return one_line(p, "p.jsonl:2: not UTF-8 text"), p


def t_prompt_outside_alphabet(w):
    p = train(w, env=_prompts(w, b'{"prompt": "ab"}\n{"prompt": "aB"}\n'))
    return one_line(p, "p.jsonl:2:", "not in the tokenizer alphabet"), p


def t_prompt_both_keys(w):
    p = train(w, env=_prompts(w, b'{"prompt": "ab", "messages": [{"role": "user", "content": "ab"}]}\n'))
    return one_line(p, "p.jsonl:1: has both 'prompt' and 'messages'"), p


def t_parquet_not_parquet(w):
    p = train(w, env=_prompts(w, b'{"prompt": "ab"}\n', name="p.parquet"))
    return one_line(p, "p.parquet: not a Parquet file"), p


def t_reward_file_missing(w):
    p = train(w, config=include(w, f"reward:\n  function: {w}/none.py:r\n"))
    return one_line(p, "none.py", "no file"), p


def t_reward_syntax_error(w):
    (w / "rw.py").write_text("def r(prompts, responses)\n    return []\n")
    p = train(w, config=include(w, f"reward:\n  function: {w}/rw.py:r\n"))
    return one_line(p, "rw.py:1: syntax error"), p


def t_reward_no_callable(w):
    (w / "rw.py").write_text("x = 1\n")
    p = train(w, config=include(w, f"reward:\n  function: {w}/rw.py:r\n"))
    return one_line(p, "has no callable 'r'"), p


def t_reward_strings(w):
    p = train(w, config=include(w, reward_file(w, "    return ['0.5' for _ in responses]\n")))
    return one_line(p, "rw.py:r returned str '0.5'"), p


def t_reward_raises_always(w):
    p = train(w, config=include(w, reward_file(w, "    raise KeyError('boom')\n")))
    return one_line(p, "every reward call of the batch failed", "KeyError"), p


def t_reward_sys_exit(w):
    p = train(w, config=include(w, reward_file(w, "    sys.exit(3)\n")))
    return one_line(p, "rw.py:r called sys.exit(3)"), p


def t_reward_os_exit(w):
    p = train(w, config=include(w, reward_file(w, "    os._exit(7)\n")))
    return one_line(p, "rw.py:r ended its worker process (exit code 7)"), p


def t_reward_huge(w):
    p = train(w, config=include(w, reward_file(w, "    return [1e30 for _ in responses]\n")))
    return one_line(p, "the reward gave 1e+30"), p


def t_reward_hangs_on_one_rank(w):
    body = ("    if os.environ['RANK'] == '1' and not os.path.exists(os.environ['MARK']):\n"
            "        open(os.environ['MARK'], 'w').close()\n        time.sleep(1e6)\n    return [0.5 for _ in responses]\n")
    p = train(w, config=include(w, reward_file(w, body)), env={"TP": "1", "MARK": str(w / "mark")})
    rows = [json.loads(x) for x in (w / "out" / "metrics.jsonl").read_text().splitlines()] if finished(p) else []
    return bool(rows) and rows[0].get("reward/timeouts") == 1, p


def t_role_file_as_top_config(w):
    p = train(w, config=REPO / "examples" / "tiny" / "ppo_policy.yaml")
    return one_line(p, "role's model file, not a top config"), p


def t_unwritable_output(w):
    (w / "file").write_text("")
    p = train(w / "file", nproc=2)
    return one_line(p, "not writable"), p


def t_existing_run_without_flag(w):
    (w / "out").mkdir()
    (w / "out" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    p = train(w)
    return one_line(p, "already holds a run"), p


def t_overwrite_bad_input_keeps_run(w):
    (w / "out").mkdir()
    (w / "out" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    (w / "out" / "run.json").write_text(json.dumps({"config_file": str(TINY), "stage": "rl"}))  # a run of this config
    p = train(w, "--overwrite", env=_prompts(w, b"not json\n"))
    return one_line(p, "not valid JSON") and (w / "out" / "metrics.jsonl").read_text() == '{"iteration": 1}\n', p


def _finished_run(w, *extra, env=None):
    p = train(w, "--overwrite", *extra, env={"ITERATIONS": "2", **(env or {})})
    assert finished(p), p.stderr[-2000:]
    return w / "out" / "checkpoints" / "iter_0000002"


def t_resume_other_settings(w):
    _finished_run(w)
    p = train(w, "--resume", env={"ITERATIONS": "3", "KL_COEF": "0.5"})
    return one_line(p, "belongs to a run with other settings", "ppo.kl_coef"), p


def t_resume_other_tp(w):
    _finished_run(w)
    p = train(w, "--resume", env={"ITERATIONS": "3", "TP": "1"})
    # Another layout resumes (checkpoints reshard), but not a role whose weights were drawn per shard.
    return one_line(p, "resumed at another layout", "reference has no load"), p


def t_resume_truncated_checkpoint(w):
    ckpt = _finished_run(w)
    state = ckpt / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    p = train(w, "--resume", env={"ITERATIONS": "3"})
    return one_line(p, "trainer_state.pt: 100 bytes"), p


def t_resume_bit_flip(w):
    ckpt = _finished_run(w)
    shard = next(ckpt.glob("ppo_policy/release/*/model_optim_rng.pt"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    p = train(w, "--resume", env={"ITERATIONS": "3"})
    return one_line(p, "differs from the manifest's checksum"), p


def t_resume_nothing_to_do(w):
    _finished_run(w)
    p = train(w, "--resume", "--iterations", "2")
    return one_line(p, "nothing to do"), p


def t_resume_torn_metrics(w):
    _finished_run(w)
    with open(w / "out" / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "rew')
    p = train(w, "--resume", env={"ITERATIONS": "3"})
    return p.returncode == 0 and "a torn record" in p.stderr and "resumed from" in p.stdout, p


def _background(w, output=subprocess.PIPE):
    """The tiny demo (40 iterations) started in the background."""
    return subprocess.Popen([PY, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_port()}",
                             "-m", "megatron_rlhf.train", "--config", str(TINY), "--output-dir", str(w / "out")],
                            cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", ITERATIONS="40"),
                            stdout=output, stderr=output, text=True)


def t_two_launches_one_directory(w):
    first = _background(w, output=subprocess.DEVNULL)
    try:
        _wait_for_metrics(w, first)
        p = train(w)
        return one_line(p, "is in use by another run", "pid"), p
    finally:
        first.kill()
        first.wait()


def _wait_for_metrics(w, process, deadline_s=120):
    deadline = time.monotonic() + deadline_s
    metrics = w / "out" / "metrics.jsonl"
    while not metrics.exists() or not metrics.read_text().strip():
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("the run did not reach iteration 1")
        time.sleep(0.2)


def _children(pid):
    return psutil.Process(pid).children(recursive=True)


def t_kill_9_torchrun(w):
    run = _background(w, output=subprocess.DEVNULL)
    _wait_for_metrics(w, run)
    ranks = _children(run.pid)
    run.kill()
    run.wait()
    _, alive = psutil.wait_procs(ranks, timeout=10)
    return not alive, None




def t_kill_9_a_rank(w):
    run = _background(w)
    _wait_for_metrics(w, run)
    ranks = [p for p in _children(run.pid) if "megatron_rlhf.train" in " ".join(p.cmdline())]
    ranks[-1].kill()
    _, err = run.communicate(timeout=120)
    # The survivor says "another rank stopped in the middle of a collective", unless torchrun stops it
    # first; torchrun reports the killed rank either way (with a traceback of its own, not ours).
    return (run.returncode != 0 and OWN_FRAMES not in err
            and ("another rank stopped in the middle of a collective" in err or re.search(r"exitcode\s*:\s*-9", err))), None


def t_sigterm_to_torchrun(w):
    run = _background(w)
    _wait_for_metrics(w, run)
    run.send_signal(signal.SIGTERM)
    run.communicate(timeout=120)
    return run.returncode != 0 and not [p for p in psutil.process_iter(["cmdline"])
                                        if str(w / "out") in " ".join(p.info["cmdline"] or [])], None


def _launcher(w, **env):
    full = dict(os.environ, MODEL_SIZE="tiny", GPUS_PER_NODE="2", ITERATIONS="40", OUTPUT_DIR=str(w / "out"),
                MASTER_PORT=_port(), PYTHON=PY)
    full.update(env)
    for name in ("TP", "PP", "NNODES"):
        full.pop(name, None)
    return full


def t_ctrl_c_under_launcher(w):
    run = subprocess.Popen(["bash", str(RUN_PPO)], cwd=w, env=_launcher(w), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_for_metrics(w, run)
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=60)
    last = [x for x in err.splitlines() if x.strip()][-1]
    return run.returncode == 130 and "Traceback" not in err and "interrupted (Ctrl-C)" in last, None


def t_collective_timeout(w):
    body = ("    if os.environ['RANK'] == '1' and not os.path.exists(os.environ['MARK']):\n"
            "        open(os.environ['MARK'], 'w').close()\n        time.sleep(60)\n    return [0.5 for _ in responses]\n")
    cfg = include(w, reward_file(w, body).replace("timeout_s: 3", "timeout_s: 120")
                  + "trainer:\n  collective_timeout_s: 5\n")
    p = train(w, config=cfg, env={"TP": "1", "MARK": str(w / "mark")})
    return one_line(p, "a collective waited longer than trainer.collective_timeout_s=5s"), p


def t_launcher_failure_line_last(w):
    (w / "out").mkdir()
    (w / "out" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    p = subprocess.run(["bash", str(RUN_PPO)], cwd=w, env=_launcher(w, ITERATIONS="2"), capture_output=True,
                       text=True, timeout=120)
    last = [x for x in p.stderr.splitlines() if x.strip()][-1]
    return p.returncode == 2 and last.startswith("error:") and "already holds a run" in last, p


def t_launcher_bad_inputs(w):
    p = subprocess.run(["bash", str(RUN_PPO)], cwd=w, env=_launcher(w, TP="16", free_memory_value="maybe"),
                       capture_output=True, text=True, timeout=60)
    return p.returncode == 2 and "nothing was launched" in p.stderr and "Traceback" not in p.stderr, p


def t_plan_model_size(w):
    p = subprocess.run([PY, "-m", "megatron_rlhf.plan", "--config", str(RUN_PPO.parent / "rlhf.yaml")], cwd=REPO,
                       env=dict(os.environ, MODEL_SIZE="70b"), capture_output=True, text=True, timeout=60)
    return p.returncode == 0 and "TP=8 PP=2 DP=2" in p.stdout, p


def t_converter_bad_flag(w):
    p = subprocess.run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", str(w), "--output", str(w / "o"), "--tp", "0"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    return p.returncode == 2 and "expected a whole number >= 1" in p.stderr and "Traceback" not in p.stderr, p


def t_converter_unmodelled_field(w):
    (w / "hf").mkdir()
    (w / "hf" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 100, "attention_bias": True}))
    p = subprocess.run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", str(w / "hf"), "--output", str(w / "o")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    return p.returncode == 2 and "attention_bias: True is not supported" in p.stderr and not (w / "o").exists(), p


def t_dry_run_without_files(w):
    p = subprocess.run([PY, "-m", "megatron_rlhf.train", "--config", str(RUN_PPO.parent / "rlhf.yaml"), "--dry-run",
                        "--world-size", "8"], cwd=REPO, env=dict(os.environ, POLICY_LOAD="/nowhere"),
                       capture_output=True, text=True, timeout=60)
    return p.returncode == 0 and "not found on this machine" in p.stdout, p


def t_lora_dropout(w):
    p = train(w, config=include(w, "ppo_policy:\n  lora: {rank: 4, dropout: 0.1}\n"))
    return one_line(p, "ppo_policy.lora.dropout: 0.1", "adapter dropout must be 0"), p


def t_lora_on_the_policy(w):
    p = train(w, config=include(w, "policy:\n  lora: {rank: 4}\n"))
    return one_line(p, "policy.lora: policy is not trained", "set ppo_policy.lora"), p


def t_lora_checkpoint_as_load(w):
    from megatron_rlhf.checkpoint.model_files import write_model_meta
    from megatron_rlhf.config.presets import PRESETS
    from megatron_rlhf.config.schema import ModelArchConfig

    import torch

    (w / "ckpt").mkdir()
    write_model_meta(str(w / "ckpt"), ModelArchConfig(**PRESETS["tiny"]), "lm", torch.float32, 1, 1,
                     {"rank": 4, "alpha": 8.0, "target_modules": ["linear_qkv"]})
    p = train(w, config=include(w, f"reference:\n  load: {w / 'ckpt'}\n"))
    return one_line(p, "reference.load", "holds LoRA adapters beside its base", "--merge-lora"), p


def t_peft_adapter_of_another_rank(w):
    (w / "adapter").mkdir()
    (w / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 16, "lora_alpha": 32, '
                                                        '"target_modules": ["q_proj", "v_proj"]}')
    (w / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    p = train(w, config=include(w, f"ppo_policy:\n  lora: {{rank: 4}}\n  load_lora: {w / 'adapter'}\n"))
    return one_line(p, "ppo_policy.load_lora", "r 16, lora_alpha 32, but the run's lora has rank 4",
                    "target_modules: ['linear_qkv']"), p


def t_partial_rollouts_with_an_environment(w):
    agent = REPO / "examples" / "tiny_agent" / "grpo.yaml"
    p = train(w, config=include(w, "rollout:\n  partial: {enabled: true}\n", base=agent))
    return finished(p), p  # supported since issue 61: trajectories resumed with their environments rebuilt


def t_partial_pool_not_splitting(w):
    grpo = REPO / "examples" / "tiny" / "grpo.yaml"
    p = train(w, config=include(w, "rollout:\n  partial: {enabled: true, over_sample: 1.05}\n", base=grpo),
              env={"TP": "1", "SAMPLES_PER_PROMPT": "3"})
    return one_line(p, "rollout.partial.over_sample: 1.05", "do not split over DP=2"), p


def t_score_head_of_two_labels(w):
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=1, vocab_size=100, num_labels=2, pad_token_id=0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(w / "hf")
    p = subprocess.run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", str(w / "hf"), "--output", str(w / "o")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    return p.returncode == 2 and "a score head of 2 labels; only one label is supported" in p.stderr \
        and not (w / "o").exists(), p


# -- round four (issue 55): agents, tools, LoRA, partial rollouts ----------------------------------

AGENT = REPO / "examples" / "tiny_agent" / "grpo.yaml"
# The agent demo with the Python tool in place of its game (the alphabet the tool's tags need).
SANDBOXED = ("data:\n  tokenizer:\n    alphabet: \"abcdefghijklmnopqrstuvwxyz <>/()+0123456789\"\nrollout:\n"
             "  environment: null\n  tools: [megatron_rlhf.agents.sandbox:python]\n  tool_parser: tags\n")


def _environment(w, body: str, timeout_s=5) -> Path:
    (w / "env.py").write_text("import time\n\n\nclass Env:\n" + body)
    return include(w, f"rollout:\n  environment: {w}/env.py:Env\n  env_timeout_s: {timeout_s}\n", base=AGENT)


def t_environment_needs_an_argument(w):
    p = train(w, config=_environment(w, "    def __init__(self, level):\n        pass\n"
                                        "    def start(self, row):\n        pass\n    def step(self, turn):\n        pass\n"))
    return one_line(p, "rollout.environment", "made with no arguments, but missing a required argument: 'level'"), p


def t_environment_blocks(w):
    started = time.monotonic()
    p = train(w, config=_environment(w, "    def start(self, row):\n        time.sleep(3600)\n"
                                        "    def step(self, turn):\n        pass\n", timeout_s=2))
    # Each worker's first two calls time out, the batch's other calls are not made: about 2 x 2 s.
    return one_line(p, "every trajectory of the batch failed", "took over 2s (rollout.env_timeout_s)") \
        and time.monotonic() - started < 60, p


def t_environment_infinite_reward(w):
    p = train(w, config=_environment(w, "    def start(self, row):\n        pass\n"
                                        "    def step(self, turn):\n        return None, True, float('inf'), {}\n"))
    return one_line(p, "environment", "step returned reward=inf; a per-turn reward is a finite number"), p


def t_stop_string_empty(w):
    p = train(w, config=include(w, "rollout:\n  stop: ['']\n", base=AGENT))
    return one_line(p, "rollout.stop", "holds an empty string"), p


def t_stop_string_outside_the_alphabet(w):
    p = train(w, config=include(w, "rollout:\n  stop: ['END']\n", base=AGENT))
    return one_line(p, "rollout.stop: 'END' cannot be written by the tokenizer"), p


def t_sandbox_without_namespaces(w):
    (w / "bin").mkdir()
    (w / "bin" / "bwrap").write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed' >&2\nexit 1\n")
    (w / "bin" / "bwrap").chmod(0o755)
    p = train(w, config=include(w, SANDBOXED, base=AGENT), env={"PATH": f"{w / 'bin'}:{os.environ['PATH']}"})
    return one_line(p, "rollout.sandbox.kind: isolated, but bubblewrap cannot make", "kind: remote"), p


def t_rollout_correction_threshold_zero(w):
    p = train(w, config=include(w, "algorithm:\n  rollout_correction: {mode: truncate, threshold: 0}\n"))
    return one_line(p, "algorithm.rollout_correction.threshold: must be > 0"), p


def t_lora_negative_rank(w):
    p = train(w, config=include(w, "ppo_policy:\n  lora: {rank: -4, alpha: 8}\n"))
    return one_line(p, "ppo_policy.lora.rank: must be >= 0, got -4") and "(off)" not in p.stderr, p


def t_peft_adapter_config_not_json(w):
    (w / "adapter").mkdir()
    (w / "adapter" / "adapter_config.json").write_text("{not json")
    (w / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    p = train(w, config=include(w, f"ppo_policy:\n  lora: {{rank: 4}}\n  load_lora: {w / 'adapter'}\n"))
    return one_line(p, "ppo_policy.load_lora", "adapter_config.json: not a JSON object"), p


def t_resume_with_another_lora_rank(w):
    lora = REPO / "examples" / "tiny" / "grpo_lora.yaml"
    first = train(w, config=lora)
    if not finished(first):
        return False, first
    p = train(w, "--resume", "--allow-config-change", config=lora, env={"ITERATIONS": "3", "LORA_RANK": "16"})
    return one_line(p, "holds networks of other shapes", "ppo_policy.lora.rank"), p


# -- round five (issue 65): stages' data and checkpoints, environments, the sandbox ------------------

PIPELINE = REPO / "examples" / "tiny_pipeline"


def t_infinite_learning_rate(w):
    p = train(w, config=include(w, "ppo_policy:\n  lr: .inf\n"))
    return one_line(p, "ppo_policy.lr", "must be finite"), p


def t_pairs_prompt_under_another_key(w):
    (w / "pairs.jsonl").write_text(json.dumps({"question": "ab", "chosen": "ab cd", "rejected": "ab ef"}) + "\n")
    p = train(w, config=include(w, f"data:\n  train_file: {w / 'pairs.jsonl'}\n", base=PIPELINE / "rm.yaml"))
    return one_line(p, "pairs.jsonl:1: no 'prompt' column, but 'question' holds text"), p


def t_sandbox_wall_time_at_the_tool_time_out(w):
    p = train(w, config=include(w, SANDBOXED + "  sandbox: {wall_s: 20}\n", base=AGENT))
    return one_line(p, "rollout.sandbox.wall_s: 20s must stay at least a second below rollout.tool_timeout_s"), p


def t_environment_that_keeps_growing(w):
    config = _environment(w, "    def start(self, row):\n        self.held = []\n"
                             "    def step(self, turn):\n        self.held.append(bytearray(64 << 20))\n"
                             "        return 'again', False, None, {}\n")
    config.write_text(config.read_text() + "  env_memory_mb: 100\n")
    p = train(w, config=config)
    return one_line(p, "every trajectory of the batch failed", "beyond rollout.env_memory_mb=100"), p


TRIALS = {name[2:]: fn for name, fn in globals().items() if name.startswith("t_")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the trials whose name contains this")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    outcomes = {}
    for name, trial in TRIALS.items():
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            started = time.monotonic()
            try:
                passed, proc = trial(Path(tmp))
                shown = proc is not None and OWN_FRAMES in (proc.stderr or "")
                outcome = "traceback" if shown else "handled" if passed else "wrong"
                detail = (errors(proc)[:1] or [""])[0][:140] if proc is not None else ""
            except Exception as e:  # the trial itself broke: count it, say why
                outcome, detail = "wrong", f"trial failed: {type(e).__name__}: {e}"[:140]
        outcomes[name] = outcome
        line = f"{name:<32} {outcome:<9} {time.monotonic() - started:5.1f}s  {detail}"
        print(f"| {name.replace('_', ' ')} | {outcome} | {detail.replace('|', '/')} |" if args.markdown else line,
              flush=True)
    counts = {o: sum(v == o for v in outcomes.values()) for o in ("handled", "traceback", "wrong")}
    print(f"{len(outcomes)} trials: " + ", ".join(f"{n} {o}" for o, n in counts.items()))
    return 0 if counts["handled"] == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
