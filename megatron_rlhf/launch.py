"""The launcher behind ``examples/llama2/run_ppo.sh``: environment variables -> a checked config ->
torchrun (or the dry run). ``python -m megatron_rlhf.launch --config rlhf.yaml [-- train flags]``.

The environment is the interface: ``MODEL_SIZE`` picks launch defaults (:data:`LAUNCH_PRESETS`:
layout, nodes, batch sizes), every variable the user exported wins over them, and the config's
``${NAME:default}`` values read the result. Every rule is checked by the config's own validation
(layout, batch sizes, types, files), whose messages name the environment variable that set a value;
what only a launch knows (nodes, the rendezvous, that a real model needs checkpoints) is checked
here. All problems are listed at once, before anything starts.

    MODEL_SIZE         tiny, 7b, 13b, 70b (Llama-2), llama3.1-8b, llama3.1-70b, qwen2.5-7b, qwen2.5-32b,
                       qwen2.5-72b, qwen3-8b, qwen3-32b, and the mixtures of experts qwen3-30b-a3b,
                       mixtral-8x7b, qwen3-235b-a22b, or auto (the architecture and layout of the converted
                       POLICY_LOAD) [7b];  REWARD_MODEL_SIZE [MODEL_SIZE]
    NNODES, GPUS_PER_NODE, MASTER_ADDR, MASTER_PORT [29500], RDZV_ID
    GPU_MEMORY         the device memory the dry run checks the plan against [80GiB]
    DRY_RUN=1          print the plan (missing files are warnings) and exit
    CHECK_ONLY=1       check everything and exit
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

from megatron_rlhf.config import ConfigError, input_problems, layout_problems
from megatron_rlhf.config.loader import read_checkpoint_meta, read_config
from megatron_rlhf.config.names import STAGES, registry
from megatron_rlhf.config.presets import AUTO

# The launch defaults every preset starts from: a cluster node of 8 GPUs. What a recipe sets (batch
# sizes, lengths, iterations, precision) stays the recipe's: a launcher default would override it
# silently (the GSM8K recipe's 1024 new tokens became 512).
_DEFAULTS = dict(NNODES=1, GPUS_PER_NODE=8)
# The end of a turn of the instruction-tuned checkpoints (a bare tokenizer.json names no end token).
_LLAMA3 = dict(_DEFAULTS, EOS_TOKEN="<|eot_id|>")
_QWEN = dict(_DEFAULTS, EOS_TOKEN="<|im_end|>")
# MODEL_SIZE -> (model preset, launch defaults). tiny: a random tiny model that checks a cluster's
# set-up end to end without checkpoints (PROMPT_FILE relative to the config's directory).
LAUNCH_PRESETS: Dict[str, Tuple[str, Dict[str, object]]] = {
    "tiny": ("tiny", dict(_DEFAULTS, TP=2, PP=1, GPUS_PER_NODE=2, ROLLOUT_BATCH_SIZE=16, TRAIN_GLOBAL_BATCH_SIZE=8,
                          INFERENCE_MICRO_BATCH_SIZE=4, GENERATION_BATCH_SIZE=8, ITERATIONS=20, MAX_PROMPT_LENGTH=32,
                          MAX_NEW_TOKENS=16, MAX_LENGTH=48, TOKENIZER_TYPE="char", PRECISION="fp32",
                          PROMPT_FILE="../tiny/prompts.jsonl")),
    "7b": ("llama2-7b", dict(_DEFAULTS, TP=2, PP=1)),
    "13b": ("llama2-13b", dict(_DEFAULTS, TP=4, PP=1)),
    "70b": ("llama2-70b", dict(_DEFAULTS, TP=8, PP=2, NNODES=4)),
    "llama3.1-8b": ("llama3.1-8b", dict(_LLAMA3, TP=2, PP=1)),
    "llama3.1-70b": ("llama3.1-70b", dict(_LLAMA3, TP=8, PP=2, NNODES=4)),
    "qwen2.5-7b": ("qwen2.5-7b", dict(_QWEN, TP=2, PP=1)),
    "qwen2.5-32b": ("qwen2.5-32b", dict(_QWEN, TP=8, PP=1, NNODES=2)),
    "qwen2.5-72b": ("qwen2.5-72b", dict(_QWEN, TP=8, PP=2, NNODES=4)),
    "qwen3-8b": ("qwen3-8b", dict(_QWEN, TP=2, PP=1)),
    "qwen3-32b": ("qwen3-32b", dict(_QWEN, TP=8, PP=1, NNODES=2)),
    # Mixtures of experts: trained at TP=1 (megatron-core trains MoE layers at TP > 1 only with
    # sequence parallelism), the experts split over EP ranks of the data-parallel ones.
    "qwen3-30b-a3b": ("qwen3-30b-a3b", dict(_QWEN, TP=1, PP=1, EP=8)),
    "mixtral-8x7b": ("mixtral-8x7b", dict(_DEFAULTS, TP=1, PP=2, EP=8, NNODES=2)),
    "qwen3-235b-a22b": ("qwen3-235b-a22b", dict(_QWEN, TP=1, PP=2, EP=32, NNODES=16)),  # planned, never run
}
PATH_VARIABLES = ("POLICY_LOAD", "REWARD_LOAD", "VALUE_LOAD", "JUDGE_LOAD", "LOAD_LORA", "TOKENIZER", "PROMPT_FILE", "VAL_FILE",
                  "TRAIN_FILE", "OUTPUT_DIR")
# STAGE -> the recipe run_ppo.sh launches (beside it) when CONFIG is not given: RL, or a stage before it.
STAGE_RECIPES = registry(STAGES, "STAGE", {"rl": "rlhf.yaml", "sft": "sft.yaml", "rm": "rm.yaml", "prm": "prm.yaml",
                                           "dpo": "dpo.yaml"})
# The checkpoint each stage starts from (a launch of a real model needs it): the reward model's for rm and prm.
STARTING_CHECKPOINT = {"rm": "REWARD_LOAD", "prm": "REWARD_LOAD"}


def _positive(env: Dict[str, str], name: str, problems: List[str]) -> Optional[int]:
    text = env.get(name, "")
    if text.isdigit() and int(text) >= 1:
        return int(text)
    problems.append(f"{name}={text}: expected a whole number >= 1")
    return None


def _auto_defaults(env: Dict[str, str], cwd: str) -> Dict[str, object]:
    """MODEL_SIZE=auto's launch defaults: TP x PP as the converted POLICY_LOAD was written (it loads
    at any other too); the rest as every preset's."""
    try:
        written = read_checkpoint_meta(os.path.join(cwd, env.get("POLICY_LOAD") or ""))
        return dict(_DEFAULTS, TP=written["tp"], PP=written["pp"])
    except (OSError, ValueError, KeyError):  # the config check names the missing checkpoint
        return dict(_DEFAULTS, TP=1, PP=1)


def resolve_environment(env: Dict[str, str], config_dir: str, cwd: str, algorithm: str = "ppo") -> List[str]:
    """Fill ``env`` in place with MODEL_SIZE's defaults for what the user did not export, and pin
    relative paths to ``cwd`` (the config reads a relative path relative to itself). ``algorithm``
    names the default output directory. Returns the problems found (an unknown size)."""
    problems = []
    size = env.setdefault("MODEL_SIZE", "7b")
    reward_size = env.setdefault("REWARD_MODEL_SIZE", size)
    for name, value in (("MODEL_SIZE", size), ("REWARD_MODEL_SIZE", reward_size)):
        if value not in LAUNCH_PRESETS and value != AUTO and not (name == "REWARD_MODEL_SIZE" and value == size):
            problems.append(f"{name}={value}: expected one of {', '.join(LAUNCH_PRESETS)}, or {AUTO} (the "
                            "architecture of the converted POLICY_LOAD / REWARD_LOAD)")
    if problems:
        return problems
    policy_preset, defaults = LAUNCH_PRESETS[size] if size != AUTO else (AUTO, _auto_defaults(env, cwd))
    env.setdefault("POLICY_PRESET", policy_preset)
    env.setdefault("REWARD_PRESET", AUTO if reward_size == AUTO else LAUNCH_PRESETS[reward_size][0])
    for name, value in defaults.items():
        if name == "PROMPT_FILE" and name not in env:
            env[name] = os.path.normpath(os.path.join(config_dir, str(value)))
        env.setdefault(name, str(value))
    named = os.path.basename(os.path.normpath(env["POLICY_LOAD"])) if size == AUTO and env.get("POLICY_LOAD") else policy_preset
    env.setdefault("OUTPUT_DIR", f"outputs/{named}-{algorithm}")
    if env.get("REWARD_LOAD") and "VALUE_LOAD" not in env:
        env["VALUE_LOAD"] = env["REWARD_LOAD"]
    for name in PATH_VARIABLES:
        if env.get(name):
            env[name] = os.path.join(cwd, env[name])  # unchanged when already absolute
    return problems


Layout = Tuple[int, int, int, int, int, int]  # world size, GPUs per node, TP, PP, DP, EP


def check(env: Dict[str, str], config_file: str, overrides: List[str] = ()) -> Tuple[List[str], List[str], Optional[Layout]]:
    """(errors, missing inputs, layout) of a launch with ``env`` and ``overrides`` (train's
    key=value). Missing inputs stop a launch but are only warnings for a dry run."""
    errors: List[str] = []
    missing: List[str] = []
    nodes, per_node = _positive(env, "NNODES", errors), _positive(env, "GPUS_PER_NODE", errors)
    if nodes and nodes > 1 and not env.get("MASTER_ADDR"):
        missing.append(f"NNODES={nodes}: a multi-node launch needs MASTER_ADDR, the first node's address "
                       "(slurm/run_ppo.sbatch sets it)")
    needs_checkpoints = env["MODEL_SIZE"] != "tiny"
    start = STARTING_CHECKPOINT.get(env.get("STAGE", "rl"), "POLICY_LOAD")
    if needs_checkpoints and not env.get(start):
        missing.append(f"{start} is not set: the directory of a converted checkpoint (tools/convert_hf_to_megatron.py)"
                       + (", or of the SFT stage's policy (its body, with a new score head)" if start == "REWARD_LOAD" else ""))
    if not (nodes and per_node):
        return errors, missing, None
    world = nodes * per_node
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # the config's ${NAME:default} values read the launch's environment
    try:
        config, problems = read_config(config_file, overrides)
    except ConfigError as e:
        return errors + [str(e)], missing, None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    errors += problems + layout_problems(config, world)
    stage = env.get("STAGE")
    if stage and stage != config.stage:
        errors.append(f"STAGE={stage}, but {config_file} runs stage: {config.stage}; set CONFIG to a recipe of stage "
                      f"{stage} (or leave CONFIG unset: examples/llama2/{STAGE_RECIPES.get(stage, 'rlhf.yaml')})")
    missing += input_problems(config, needs_prompts=True)
    # RL scores with a reward model it loads; the rm stage trains one
    if needs_checkpoints and config.stage == "rl" and config.reward.type == "model" and not env.get("REWARD_LOAD"):
        missing.append("REWARD_LOAD is not set: the directory of a converted reward model (tools/convert_hf_to_megatron.py); "
                       "a rule reward (reward.type: function) needs none")
    if errors:
        return errors, missing, None
    par = config.parallel
    tp, pp, ep = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size
    return errors, missing, (world, per_node, tp, pp, world // par.replica_ranks(), ep, par.context_parallel_size)


def torchrun_command(env: Dict[str, str], config_file: str, train_args: List[str]) -> List[str]:
    launch = ["--nnodes", env["NNODES"], "--nproc-per-node", env["GPUS_PER_NODE"]]
    if env.get("MASTER_ADDR"):
        launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}",
                   "--rdzv-id", env.get("RDZV_ID", "megatron-rlhf")]
    else:
        launch.append("--standalone")
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "megatron_rlhf.train",
            "--config", config_file, *train_args]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megatron_rlhf.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="the top config file, e.g. examples/llama2/rlhf.yaml (default: --recipes' "
                                          "recipe of $STAGE)")
    parser.add_argument("--recipes", help="the directory of the STAGE recipes (STAGE_RECIPES), for a launch without --config")
    parser.add_argument("--name", default="megatron_rlhf.launch", help="how messages name the launcher")
    parser.add_argument("train_args", nargs="*", help="after --: flags for megatron_rlhf.train (e.g. --overwrite)")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    stage = env.get("STAGE", "rl")
    if stage not in STAGE_RECIPES:
        print(f"error: STAGE={stage}: expected one of {', '.join(STAGE_RECIPES)}\n{args.name}: nothing was launched",
              file=sys.stderr)
        return 2
    if not args.config and not args.recipes:
        parser.error("give --config, or --recipes (the directory of the STAGE recipes)")
    config_file = os.path.abspath(args.config or os.path.join(args.recipes, STAGE_RECIPES[stage]))
    stem = os.path.splitext(os.path.basename(config_file))[0]
    problems = resolve_environment(env, os.path.dirname(config_file), os.getcwd(), "ppo" if stem == "rlhf" else stem)
    if not os.path.isfile(config_file):
        problems.append(f"CONFIG={args.config}: no such file")
    missing, layout = [], None
    if not problems:
        problems, missing, layout = check(env, config_file, [a for a in args.train_args if "=" in a and not a.startswith("-")])
    dry = env.get("DRY_RUN") == "1"
    if dry:
        for m in missing:
            print(f"warning: {m} (a real launch stops here)", file=sys.stderr)
    else:
        problems += missing
    if problems or layout is None:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        print(f"{args.name}: nothing was launched", file=sys.stderr)
        return 2
    world, per_node, tp, pp, dp, ep, cp = layout
    if tp > per_node:
        print(f"warning: TP={tp} > GPUS_PER_NODE={per_node}: tensor-parallel traffic crosses nodes", file=sys.stderr)
    # EMS frees large storages and grows them back at every phase: expandable segments let the CUDA
    # allocator map and unmap them in place instead of leaving fragments of fixed segments reserved.
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ.update(env)
    if dry:
        from megatron_rlhf.dry_run import dry_run
        from megatron_rlhf.errors import hide_internal_warnings

        hide_internal_warnings()
        from megatron_rlhf.units import parse_bytes

        return dry_run(config_file, world, per_node, parse_bytes(env.get("GPU_MEMORY", "80GiB")))
    what = (f"{env['MODEL_SIZE']}, {world} GPUs (TP={tp} PP={pp}{f' CP={cp}' if cp > 1 else ''} DP={dp}{f' EP={ep}' if ep > 1 else ''}), output {env['OUTPUT_DIR']}, "
            f"PYTORCH_CUDA_ALLOC_CONF={env['PYTORCH_CUDA_ALLOC_CONF']}")
    if env.get("CHECK_ONLY") == "1":  # the inputs too, as a launch reads them (tokenizer, data, rewards)
        import subprocess

        checked = subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--config", config_file, "--check-only",
                                  "--world-size", str(world), *args.train_args], env=env)
        if checked.returncode != 0:
            print(f"{args.name}: nothing was launched", file=sys.stderr)
            return 2
        print(f"{args.name}: inputs checked: {what}")
        return 0
    print(f"{args.name}: launching {what} on {os.uname().nodename}", flush=True)
    return run_torchrun(torchrun_command(env, config_file, args.train_args), env, args.name)


def run_torchrun(command: List[str], env: Dict[str, str], name: str) -> int:
    """torchrun as this process's child, in a session of its own (killed if this process dies), its
    output and its ranks' passed through but for torchrun's own report of failed ranks (its
    ChildFailedError traceback and table, which only repeat that a rank failed): a failed run ends
    with the rank's one ``error:`` line and status 2. Ctrl-C reaches only this process: torchrun
    and its ranks are killed at once (checkpoints are written whole or not at all) and one line
    says so, status 130. A scheduler's SIGTERM or a hang-up is passed on to torchrun, which stops
    the ranks."""
    import signal
    import subprocess
    import tempfile
    import threading

    from megatron_rlhf.train import ERROR_FILE_VARIABLE, die_with_parent

    with tempfile.NamedTemporaryFile("r", suffix=".error", encoding="utf-8") as error_file:
        process = subprocess.Popen(command, env=dict(env, **{ERROR_FILE_VARIABLE: error_file.name}),
                                   stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
                                   preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        report = TorchrunReport()
        relay = threading.Thread(target=report.relay, args=(process.stderr, sys.stderr), daemon=True)
        relay.start()
        received = []

        def pass_on(signum, frame):
            received.append(signal.Signals(signum).name)
            process.send_signal(signum)

        for passed_on in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(passed_on, pass_on)
        try:
            code = process.wait()
            relay.join()
        except KeyboardInterrupt:
            process.kill()  # its ranks follow (parent-death signal)
            process.wait()
            print(f"{name}: interrupted (Ctrl-C); the last checkpoint is kept: --resume (RESUME=auto) continues "
                  "from it", file=sys.stderr, flush=True)
            return 130
        if received:
            print(f"{name}: stopped by {received[0]}, passed on to torchrun; the last checkpoint is kept",
                  file=sys.stderr, flush=True)
            return code
        if code != 0:
            said = error_file.read().strip()
            if said and report.held_back:  # the rank's line was the run's last word
                return 2
            print(f"{name}: the run failed (exit status {code})" + (f": {said}" if said else ""), file=sys.stderr,
                  flush=True)
            if report.held_back and not said:  # no line of ours: torchrun's report is all there is
                sys.stderr.writelines(report.held_back)
    return code


class TorchrunReport:
    """Passes a torchrun's stderr through, holding back its own report of failed ranks: a
    traceback ending in ChildFailedError and the table after it (``held_back``)."""

    def __init__(self):
        self.held_back: List[str] = []

    def relay(self, source, sink) -> None:
        block: List[str] = []  # a traceback being read: whose it is shows at its last line
        said = False  # a rank's error: line passed: torchrun's log of stopping the others follows
        for line in source:
            if self.held_back or (said and re.match(r"[WE]\d{4} .*torch/distributed/elastic/", line)):
                self.held_back.append(line)
            elif block:
                block.append(line)
                if not line.startswith((" ", "\t")) and not line.startswith("Traceback"):
                    if "ChildFailedError" in line:
                        self.held_back = block
                    else:
                        sink.writelines(block)
                        sink.flush()
                    block = []
            elif line.startswith("Traceback (most recent call last):"):
                block = [line]
            else:
                said = said or line.startswith("error:")
                sink.write(line)
                sink.flush()
        sink.writelines(block)
        sink.flush()


if __name__ == "__main__":
    sys.exit(main())
