"""Everything a launch checks before any process group or model exists (``prepare``): the config,
the output directory (writable; an earlier run neither mixed in nor lost by accident), the
checkpoint to resume, the tokenizer, the rows and rewards, the environment and its tools, the
checkpoints and adapters the roles load, the host's memory. Every stage's launch and
``--check-only`` start here; a fault is a ConfigError (one ``error:`` line), never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import warnings
from typing import Any, Dict, List, Optional

from megatron_rlhf.checkpoint.run_state import (check_overwrite, check_resume, completed_iterations, lock_output_dir,
                                                record_run, remove_partial_saves, restore_set_aside, run_identity,
                                                set_aside_run)
from megatron_rlhf.config import ConfigError, input_problems, load_config
from megatron_rlhf.config.presets import CHECKPOINT_META_FILE
from megatron_rlhf.config.schema import ROLE_HEADS, RLHFConfig
from megatron_rlhf.dry_run import host_text
from megatron_rlhf.units import human


# What prepare() raises for bad input (config, data, tokenizer, rewards): one line, no traceback.
INPUT_ERRORS = (ConfigError, ValueError, FileNotFoundError)


@dataclasses.dataclass
class Prepared:
    """What a run starts from, all checked before any process group or model exists."""

    config: RLHFConfig
    output_dir: str
    tokenizer: Any
    dataset: Any
    val_dataset: Any  # None without data.val_file
    reward_functions: Optional[Dict[str, float]]  # rule reward specs (files absolute) -> weight
    resume_from: Optional[str]  # the checkpoint to continue from
    run: Dict[str, Any]  # id, config fingerprint and values: saved with every checkpoint
    environment: Optional[str] = None  # the multi-turn environment's spec (file absolute)


def prepare(args: argparse.Namespace, world_size: int) -> Prepared:
    """Everything that can fail on bad input, before any process group or model exists: the
    config, the output directory (writable; an earlier run in it is neither mixed in nor lost by
    accident), the checkpoint to resume (complete, same layout, same run), the tokenizer, the
    rows (RL: the prompt file, the reward function; a stage before RL: its training and validation
    rows) and the generation engine's switches (MEGATRON_RLHF_CPU_LINEARS, MEGATRON_RLHF_DECODE_GRAPHS).
    With ``args.check_only`` nothing is written (no lock, nothing set aside)."""
    from megatron_rlhf.data import build_tokenizer
    from megatron_rlhf.rewards.contract import reward_functions
    from megatron_rlhf.generation.decode import graphs_wanted
    from megatron_rlhf.runtime.cpu_linears import chosen_kernel

    writes = not args.check_only

    chosen_kernel()  # read again by every generation: a bad value is refused here, not at the first one
    graphs_wanted()  # the same
    config = load_config(args.config, world_size=world_size, check_inputs=False, overrides=args.overrides)
    problems = input_problems(config, needs_prompts=True)
    if problems:
        raise ConfigError("missing input:\n  " + "\n  ".join(problems))
    _check_loaded_checkpoints(config)
    _batch_invariant_arithmetic(config)
    if args.iterations is not None:
        if args.iterations < 1:
            raise ConfigError(f"--iterations: must be >= 1, got {args.iterations}")
        section, key = config.steps_key.split(".")
        setattr(getattr(config, section), key, args.iterations)
    check_host_memory(config, world_size)
    output_dir = args.output_dir or config.trainer.output_dir
    _check_writable(output_dir, create=writes)
    if launch_rank0() and writes:
        lock_output_dir(output_dir)
        for name in remove_partial_saves(output_dir):
            print(f"removed {name}: a checkpoint save that did not finish (its process ended while writing)", flush=True)
        if restore_set_aside(output_dir):  # a launch that --overwrite'd it died before its first iteration
            warnings.warn(f"{output_dir}: put back the run an --overwrite launch set aside and never replaced")
    if args.resume:
        config.trainer.resume = "auto"
    run, resume_from, reached = _resume_point(args, config, output_dir)
    if config.trainer.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(f"{config.at('trainer.wandb')}: true, but the wandb package is not installed; install "
                              "it with pip install -e .[wandb] (or pip install wandb), or set wandb: false") from None
    tokenizer = build_tokenizer(config.data.tokenizer, config.path_of("data.tokenizer.path"))
    _check_tokenizer_records(config, tokenizer)
    # RL's reward and value models may come with a vocabulary of their own; a stage's roles read its ids
    readers = config.model_roles if config.stage != "rl" else [r for r in config.model_roles if ROLE_HEADS[r] == "lm"]
    for role in readers:  # the roles that read the tokenizer's ids
        model_vocab = config.role(role).model.vocab_size
        if tokenizer.vocab_size > model_vocab:
            raise ConfigError(
                f"{config.source_of(role + '.model')}: {role}.model.vocab_size: {model_vocab} is smaller "
                f"than the tokenizer's vocabulary ({tokenizer.vocab_size}); use at least {tokenizer.vocab_size}"
            )
    if config.stage != "rl":  # the inputs a stage reads: its rows; RL's below: prompts, rewards, environments
        dataset, val_dataset = _stage_rows(config, tokenizer, world_size)
        _check_stage_steps(config, len(dataset), resume_from, reached)
        _claim(output_dir, config, args.overwrite and writes, writes)
        return Prepared(config, output_dir, tokenizer, dataset, val_dataset, None, resume_from, run)
    if config.judge.enabled:
        _check_judge(config, tokenizer)
    tools = _tool_specs(config)  # loaded, and their sandbox tried, once for both files
    dataset = _dataset(config, "data.prompt_file", tokenizer, tools)
    if resume_from is not None:
        _check_held_groups(config, resume_from, len(dataset))
    if len(dataset) < config.ppo.rollout_batch_size:
        warnings.warn(f"{dataset.rows.path}: {len(dataset)} prompts, fewer than one rollout batch; prompts repeat within a batch")
    val_dataset = _dataset(config, "data.val_file", tokenizer, tools, shuffle=False) if config.data.val_file else None
    functions = reward_functions(config) if config.reward.type == "function" else None
    for data in (dataset, val_dataset):
        if functions and data is not None:
            _check_reward_columns(config, functions, data)
    environment = _environment(config, tokenizer) if config.rollout.multi_turn else None
    if launch_rank0():
        _show_inputs(config, tokenizer, dataset)
    _claim(output_dir, config, args.overwrite and writes, writes)
    return Prepared(config, output_dir, tokenizer, dataset, val_dataset, functions, resume_from, run, environment)


def _check_judge(config: RLHFConfig, tokenizer) -> None:
    """The judge's template (its file read) shows the response and encodes with the run's tokenizer;
    its parser function imports."""
    from megatron_rlhf.config.validation import judge_template_problem
    from megatron_rlhf.rewards.contract import absolute_spec, load_reward_function
    from megatron_rlhf.rollout.judging import judge_prompt, read_template

    if config.judge.parser == "function":
        base = config.base_dir_of("judge.parser_function")
        try:
            load_reward_function(absolute_spec(config.judge.parser_function, base), base, "parser function")
        except ValueError as e:
            raise ConfigError(f"{config.at('judge.parser_function')}: {e}") from None

    key = next(f"judge.{k}" for k in ("template", "template_file", "messages") if getattr(config.judge, k) is not None)
    try:
        template = read_template(config)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config.at(key)}: cannot be read ({e})") from None
    problem = judge_template_problem(template) if isinstance(template, str) else None
    if problem is None:
        try:
            tokenizer.encode_prompt(judge_prompt(template, "", "", ""), chat=config.data.apply_chat_template)
        except ValueError as e:
            problem = f"the run's tokenizer cannot encode it: {e}"
    if problem:
        raise ConfigError(f"{config.at(key)}: {problem}")


def _claim(output_dir: str, config: RLHFConfig, overwrite: bool, writes: bool) -> None:
    """Every input checked: the earlier run set aside (``overwrite``; dropped after the first
    iteration, put back if the launch fails before) and the directory recorded as this config's run."""
    if launch_rank0() and writes:
        if overwrite:
            set_aside_run(output_dir)
        record_run(output_dir, config)


def _check_held_groups(config: RLHFConfig, resume_from: str, prompts: int) -> None:
    """The groups a partial-rollout checkpoint holds are of this run's kind (responses, or
    trajectories with an environment: rollout/partial_turns.py) and answer prompts the prompt file
    still has."""
    from megatron_rlhf.checkpoint.run_checkpoint import read_trainer_state

    held = (read_trainer_state(resume_from)["steps"].get("partial") or {}).get("held")
    if held is None:
        return
    trajectories = isinstance(held, list)
    if trajectories != config.rollout.multi_turn:
        raise ConfigError(f"{resume_from} holds partial rollouts {'with' if trajectories else 'without'} an environment, "
                          f"and this run has {'none' if trajectories else 'one'} ({config.at('rollout.environment')}); "
                          "resume as it was written, or start again with --overwrite")
    last = max(h["prompt_index"] for h in held) if trajectories else int(held["prompt_index"].max())
    if last >= prompts:
        raise ConfigError(f"{config.at('data.prompt_file')}: {prompts} prompts, but {resume_from} holds partial "
                          f"rollouts of prompt {last + 1} (the file it was written with was longer); resume with that "
                          "file, or start again with --overwrite")


def _stage_rows(config: RLHFConfig, tokenizer, world_size: int):
    """A stage's training and validation rows (every row encoded and checked, errors naming file
    and row), enough of them for one step and for every DP rank; the first shown as the model reads it."""
    from megatron_rlhf.stages import read_rows

    try:
        rows = read_rows(config, "data.train_file", tokenizer)
        val_rows = read_rows(config, "data.val_file", tokenizer) if config.data.val_file else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    trained, unit = config.trainable_roles[0], config.sample_unit
    step = config.samples_per_step(trained)
    if len(rows) < step:
        raise ConfigError(f"{config.at('data.train_file')}: {len(rows)} {unit}, fewer than one optimizer step of "
                          f"{trained}.global_batch_size={step}")
    par, role = config.parallel, config.role(trained)
    dp = world_size // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size)
    # a pipelined forward takes equal micro-batches: each rank's share a whole number of them
    least = dp * (role.micro_batch_size if par.pipeline_model_parallel_size > 1 and role.token_budget is None else 1)
    if val_rows is not None and len(val_rows) < least:
        raise ConfigError(f"{config.at('data.val_file')}: {len(val_rows)} {unit}, fewer than the {least} that "
                          f"validation shares over {dp} data-parallel ranks")
    for what, data in (("training", rows), ("validation", val_rows)):
        if data is not None and data.cut:
            warnings.warn(f"{data.path}: {data.cut} of {len(data)} {what} {unit} have responses longer than "
                          f"{config.stage}.max_length={config.stage_config.max_length} tokens with their prompt; "
                          "each keeps its first tokens")
    if launch_rank0():
        if config.stage == "prm":
            first, what, counted = rows.rows[0], "row", f"{rows.rows[0].steps} steps scored"
        else:
            first, what = (rows.rows[0], "row") if config.stage == "sft" else (rows.pairs[0].chosen, "chosen side")
            counted = f"{first.response_tokens} trained"
        text = tokenizer.show(first.ids)
        print(f"first {what} ({len(first.ids)} tokens, {counted}): {text[:600]!r}{' ...' if len(text) > 600 else ''}",
              flush=True)
    return rows, val_rows


def _resume_point(args: argparse.Namespace, config: RLHFConfig, output_dir: str):
    """(the run's identity, the checkpoint to continue from or None, the iterations it holds): an
    earlier run in the output directory is continued (--resume, trainer.resume: auto), or refused
    unless --overwrite."""
    from megatron_rlhf.checkpoint.run_checkpoint import latest_checkpoint

    run = run_identity(config)
    resume_from, reached = None, 0
    if args.overwrite:  # it clears the old run last, once every input below has been checked
        check_overwrite(output_dir, config)
    else:
        latest = latest_checkpoint(output_dir)
        done = completed_iterations(os.path.join(output_dir, "metrics.jsonl"))
        if config.trainer.resume == "auto" and latest is not None:
            resume_from = latest
            run, reached = check_resume(latest, config, run, output_dir, args.allow_config_change)
            if config.stage == "rl" and config.ppo.iterations <= reached:  # a stage: _check_stage_steps
                raise ConfigError(f"{latest} is at iteration {reached} and the run is to end at "
                                  f"{config.ppo.iterations} ({'--iterations' if args.iterations else 'ppo.iterations'}): "
                                  f"nothing to do; resume with more than {reached} iterations")
        elif done:
            hint = (f"pass --resume to continue it from {os.path.basename(latest)}, " if latest else
                    "it has no checkpoint to resume from; ")
            raise ConfigError(f"{output_dir} already holds a run ({done} iterations in metrics.jsonl); {hint}choose "
                              "another --output-dir, or pass --overwrite to delete it and start again")
    return run, resume_from, reached


def _check_stage_steps(config: RLHFConfig, rows: int, resume_from: Optional[str], reached: int) -> None:
    """A resumed stage has steps left to run (data/epochs.py counts them from the rows)."""
    from megatron_rlhf.data.epochs import EpochOrder

    section, total = config.stage_config, EpochOrder.of(config, rows).total_steps
    if resume_from is not None and reached >= total:
        raise ConfigError(f"{resume_from} is at step {reached} and the run has {total} steps ({config.stage}.epochs="
                          f"{section.epochs}, {config.stage}.max_steps or --iterations): nothing to do; resume with "
                          "more epochs or steps")


def _environment(config: RLHFConfig, tokenizer) -> str:
    """The multi-turn environment's spec (a custom one, or the built-in tool environment), loaded
    once; the chat template's reply tokens checked (rollout/multiturn.py)."""
    from megatron_rlhf.agents.protocol import environment_spec
    from megatron_rlhf.rollout.multiturn import MultiTurn

    _check_stop_strings(config, tokenizer)
    try:
        if config.rollout.uses_tools:  # the built-in tool environment (its tools loaded with the prompts)
            from megatron_rlhf.agents.tool_environment import SPEC as spec
        else:
            spec = environment_spec(config)
        MultiTurn(config, tokenizer, spec, config.data.apply_chat_template)
    except ValueError as e:
        raise ConfigError(f"{config.at('rollout.environment' if config.rollout.environment else 'rollout.tools')}: {e}") from None
    return spec


def _check_stop_strings(config: RLHFConfig, tokenizer) -> None:
    """Each of rollout.stop is text the tokenizer writes (else it could never end a turn)."""
    for text in config.rollout.stop:
        try:
            ids = tokenizer.encode_text(text)
        except ValueError as e:
            raise ConfigError(f"{config.at('rollout.stop')}: {text!r} cannot be written by the tokenizer ({e}); use "
                              "text within its vocabulary") from None
        if not ids:
            raise ConfigError(f"{config.at('rollout.stop')}: {text!r} encodes to no token; remove it")


def _batch_invariant_arithmetic(config) -> None:
    """trainer.batch_invariant: the arithmetic of every model this process builds, set before any is
    (models/batch_invariant.py), its key blocks sized by the run's sequence length."""
    from megatron_rlhf.models import batch_invariant
    from megatron_rlhf.runtime.platform import get_platform

    if not config.trainer.batch_invariant:
        batch_invariant.switch_off()
        return
    if get_platform().name != "cpu":
        raise ConfigError(f"{config.at('trainer.batch_invariant')}: true is shown on CPU only so far; on "
                          f"{get_platform().name} the kernels are not yet verified invariant: set it to false")
    batch_invariant.switch_on(config.sequence_tokens)


def _check_loaded_checkpoints(config: RLHFConfig) -> None:
    """Every ``<role>.load`` checkpoint has its files at their manifest's sizes (the converter
    writes one), or, without one, each file readable to its end: a truncated or missing shard stops
    the run here, not while roles are built. A PEFT adapter (load_lora) fits and is finite. A
    LoRA run's checkpoint (base and adapters) is not a starting point: it is named with what is."""
    from megatron_rlhf.checkpoint.model_files import (MANIFEST, CheckpointError, check_readable, read_model_meta,
                                                      verify_checkpoint)
    from megatron_rlhf.checkpoint.peft import peft_adapters

    for role in config.model_roles:
        path = config.path_of(role + ".load")
        if path and os.path.isfile(os.path.join(path, CHECKPOINT_META_FILE)) and read_model_meta(path)[1].get("lora"):
            raise ConfigError(f"{config.at(role + '.load')}: {path} holds LoRA adapters beside its base (a LoRA run's "
                              "checkpoint); continue that run with --resume, start from its adapters as a PEFT "
                              "adapter (tools/convert_megatron_to_hf.py --peft-output, then load_lora), or from its "
                              "weights with the adapters merged (--merge-lora, then convert_hf_to_megatron.py)")
        if path and os.path.isdir(path):
            try:  # with a manifest, its sizes; a directory copied out without one, each file's own structure
                verify_checkpoint(path, checksums=False) if os.path.isfile(os.path.join(path, MANIFEST)) \
                    else check_readable(path)
            except CheckpointError as e:
                raise ConfigError(f"{config.at(role + '.load')}: {e}") from None
    if config.reward.normalize and config.stage == "rl":  # RL scores by a reward model; rm trains one
        from megatron_rlhf.checkpoint.model_files import recorded_scores

        if config.reward.type != "model" or not config.reward.load:
            raise ConfigError(f"{config.at('reward.normalize')}: true, but the reward is "
                              + ("a function" if config.reward.type != "model" else "a model without reward.load")
                              + ": the statistics come from a reward model's checkpoint (stage rm's)")
        try:
            recorded_scores(config.path_of("reward.load"))
        except CheckpointError as e:
            raise ConfigError(f"{config.at('reward.normalize')}: {e}") from None
    for role in (r for r in config.trainable_roles if config.role(r).load_lora):
        try:
            peft_adapters(config.path_of(role + ".load_lora"), config.role(role).lora, config.role(role).model,
                          read=False)  # the header's shapes: the roles read the tensors once, when built
        except CheckpointError as e:
            raise ConfigError(f"{config.at(role + '.load_lora')}: {e}") from None


def _check_tokenizer_records(config: RLHFConfig, tokenizer) -> None:
    """A role loading a model trained here reads the ids of the tokenizer that model was trained
    with (its checkpoint records it): another one, even of the same size, would feed it other text."""
    from megatron_rlhf.checkpoint.model_files import read_model_meta

    ours = tokenizer.record()
    for role in config.model_roles:
        path = config.path_of(role + ".load")
        if not path or not os.path.isfile(os.path.join(path, CHECKPOINT_META_FILE)):
            continue
        recorded = read_model_meta(path)[1].get("tokenizer")
        if recorded and recorded.get("fingerprint") != ours["fingerprint"]:
            raise ConfigError(
                f"{config.at(role + '.load')}: {path} was trained with the tokenizer {recorded.get('source')} "
                f"({recorded.get('vocab_size')} tokens, fingerprint {recorded.get('fingerprint')}), but this run's "
                f"data.tokenizer is {ours['source']} ({ours['vocab_size']} tokens, fingerprint {ours['fingerprint']}): "
                "the model would read its ids as other text; use the tokenizer it was trained with")


def _show_inputs(config: RLHFConfig, tokenizer, dataset) -> None:
    """What the model will read, said once at start-up: the end tokens (and end-like tokens of the
    vocabulary that are not among them), and the first prompt as rendered, special tokens shown."""
    print(f"end tokens: {', '.join(tokenizer.end_tokens())}", flush=True)
    unused = tokenizer.unused_end_like_tokens()
    if unused:
        warnings.warn(f"{config.at('data.tokenizer.path')}: the vocabulary has {', '.join(unused)}, which do not end a "
                      "response here; if the model ends its answers with them, list them in data.tokenizer.eos_tokens")
    first = dataset.batch_of(dataset.usable_indices()[:1] or [0])
    ids = first["tokens"][0, : int(first["lengths"][0])].tolist()
    text = tokenizer.show(ids)
    print(f"first prompt ({len(ids)} tokens): {text[:600]!r}{' ...' if len(text) > 600 else ''}", flush=True)
    if config.ppo_policy.load_lora and config.served_weights.get("reference") == "ppo_policy":
        print(f"reference: ppo_policy's base without the adapter of {config.at('ppo_policy.load_lora')} (verl's "
              "ref_in_actor); for the KL to base + adapter, set reference.load to their merged checkpoint", flush=True)


# A ground truth longer than this is said at start-up (an answer is rarely longer than a line).
LONG_GROUND_TRUTH = 10_000


def _check_reward_columns(config: RLHFConfig, functions: Dict[str, float], dataset) -> None:
    """Every column a reward function needs is in every row of ``dataset``, and a built-in
    verifier's ground truths are answers it can compare (a string or number, or a list of them)."""
    from megatron_rlhf.rewards.contract import (TRL_ARGUMENTS, load_reward_function, required_fields,
                                                unsupported_arguments)

    key = "reward.function" if config.reward.functions is None else "reward.functions"
    loaded = {spec: load_reward_function(spec, "/") for spec in functions}
    for spec, fn in loaded.items():
        unsupported = unsupported_arguments(fn)
        if unsupported:
            raise ConfigError(f"{config.at(key)}: {spec} takes TRL's arguments and requires "
                              f"{', '.join(unsupported)}, which no trainer here passes; it is given "
                              f"{' and '.join(TRL_ARGUMENTS)} and the row's columns by keyword: give the others a "
                              "default or drop them")
    needs = {spec: required_fields(fn) for spec, fn in loaded.items()}
    verifier = any(spec.startswith("megatron_rlhf.rewards.verifiers:") and "ground_truth" in n for spec, n in needs.items())
    warned_long = False
    for index in range(len(dataset)):
        fields = dataset.rows.prompt_and_fields(index)[1]
        for spec, names in needs.items():
            missing = [n for n in names if n not in fields]
            if missing:
                raise ConfigError(f"{config.at(key)}: {spec} needs the column {', '.join(map(repr, missing))}, which "
                                  f"{dataset.rows.where(index)} does not have (its columns: "
                                  f"{', '.join(sorted(fields)) or 'none'}); add it to the data or drop the function")
        truth = fields.get("ground_truth")
        if verifier and not _comparable_answer(truth):
            raise ConfigError(f"{dataset.rows.where(index)}: ground_truth {json.dumps(truth, default=str)[:80]} is not an "
                              "answer the verifiers compare: a string or a number, or a list of them (any is right)")
        size = len(str(truth)) if verifier and truth is not None else 0
        if size > LONG_GROUND_TRUTH and not warned_long:
            warned_long = True
            warnings.warn(f"{dataset.rows.where(index)}: ground_truth of {size} characters; the verifier parses it "
                          "against every response to the prompt (a 1 MB one made an iteration 80x slower): is it an "
                          "answer, or a whole solution in the wrong column?")


def _comparable_answer(truth) -> bool:
    plain = (str, int, float)
    if isinstance(truth, bool):
        return False
    if isinstance(truth, plain):
        return True
    return isinstance(truth, (list, tuple)) and bool(truth) and all(isinstance(t, plain) and not isinstance(t, bool)
                                                                   for t in truth)


def _tool_specs(config: RLHFConfig) -> Optional[List[dict]]:
    """The function specs of rollout.tools (shown by the chat template in every prompt), or None."""
    if not config.rollout.uses_tools:
        return None
    from megatron_rlhf.agents.tool_environment import tool_options, tool_set_of

    try:
        tools, _ = tool_set_of(tool_options(config), keep_servers=False)
    except ValueError as e:
        raise ConfigError(f"{config.at('rollout.tools' if config.rollout.tools else 'rollout.mcp_servers')}: {e}") from None
    _check_sandbox(config, tools.values())
    return [tool.spec for tool in tools.values()]


def _check_sandbox(config: RLHFConfig, tools) -> None:
    """A run whose tools run code is refused where its sandbox cannot run here (never a weaker
    one instead); without isolation it says so."""
    from megatron_rlhf.agents.sandbox import readiness_problem, uses_sandbox
    from megatron_rlhf.agents.sandbox.isolation import WAYS_OUT

    settings = config.rollout.sandbox
    if not uses_sandbox(tools):
        return
    if settings.unsafe:
        warnings.warn(f"{config.at('rollout.sandbox.kind')}: unsafe_process: model-written code runs without the "
                      "kernel's isolation (an audit hook and limits only); it can reach this machine's files, processes "
                      "and network (calls counted in rollout/tool_unsafe_calls)")
        return
    problem = readiness_problem(settings)
    if problem and settings.remote:
        raise ConfigError(f"{config.at('rollout.sandbox.url')}: {problem}; start the SandboxFusion service or correct "
                          "its URL")
    if problem:
        raise ConfigError(f"{config.at('rollout.sandbox.kind')}: {settings.kind}, but {problem}; {WAYS_OUT}")


def launch_rank0() -> bool:
    """Whether this process is global rank 0 (from torchrun's environment: no process group yet)."""
    return int(os.environ.get("RANK", "0")) == 0


def _dataset(config: RLHFConfig, key: str, tokenizer, tools: Optional[List[dict]], shuffle: Optional[bool] = None):
    """The prompts of the file at ``key`` (``tools``: the specs every prompt shows), every one
    tokenized once to find errors (file and line) and to count those longer than
    data.max_prompt_length (reported)."""
    from megatron_rlhf.data import PromptDataset

    data = config.data
    dataset = PromptDataset.from_file(config.path_of(key), tokenizer, data, config.seed, shuffle, tools)
    try:
        overlong = dataset.check_encodes()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if overlong == len(dataset) and data.overlong_prompts == "filter":
        raise ConfigError(f"{config.at(key)}: every one of the {len(dataset)} prompts of {dataset.rows.path} is longer "
                          f"than data.max_prompt_length={data.max_prompt_length} tokens; raise it, or set "
                          "data.overlong_prompts: truncate")
    if overlong:
        what = "are skipped" if data.overlong_prompts == "filter" else "keep only their last tokens"
        warnings.warn(f"{dataset.rows.path}: {overlong} of {len(dataset)} prompts are longer than "
                      f"data.max_prompt_length={data.max_prompt_length} tokens and {what} (data.overlong_prompts)")
    return dataset


def _check_writable(output_dir: str, create: bool = True) -> None:
    """``output_dir`` can be written (made if missing; without ``create``: the nearest existing
    directory on its path is writable, nothing made)."""
    if not create:
        existing = os.path.abspath(output_dir)
        while not os.path.isdir(existing):
            existing = os.path.dirname(existing)
        if not os.access(existing, os.W_OK):
            raise ConfigError(f"output directory {output_dir}: not writable ({existing}); choose another "
                              "--output-dir (or trainer.output_dir)")
        return
    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir):
            pass
    except OSError as e:
        raise ConfigError(f"output directory {output_dir}: not writable ({e.strerror}); choose another "
                          "--output-dir (or trainer.output_dir)") from None


def check_host_memory(config: RLHFConfig, world_size: int) -> None:
    """EMS's host arenas of every rank on this node (the planner's exact figure; torchrun's
    LOCAL_WORLD_SIZE ranks), and the state a checkpoint save gathers on the node's writing ranks
    beside them, must fit in the memory the node has available now."""
    import psutil

    from megatron_rlhf.dry_run import checkpoint_text
    from megatron_rlhf.memory.planner import checkpoint_plan, plan

    ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    planned = plan(config, world_size)
    need, available = planned.host_bytes * ranks_on_node, psutil.virtual_memory().available
    if need > available:
        raise ConfigError(
            f"EMS would hold {human(need)} of host memory on this node, more than the {human(available)} available: "
            f"{host_text(planned, ranks_on_node)}. Offload less (offload_weights / offload_optimizer_state: false "
            "for some roles; `python -m megatron_rlhf.plan --gpu-memory ...` finds what the GPUs need), raise TP/PP, "
            "or run fewer ranks per node")
    if config.trainer.save_interval or config.trainer.save_at_end:
        saving = checkpoint_plan(config, world_size, ranks_on_node)
        if need + saving.node_bytes > available:
            raise ConfigError(
                f"a checkpoint save would hold {human(need + saving.node_bytes)} of host memory on this node (EMS "
                f"arenas {human(need)} and the state each rank copies to write it), more than the {human(available)} "
                f"available: {checkpoint_text(saving)}. Raise TP/PP or DP (each rank's share shrinks), run fewer ranks "
                "per node, or save no checkpoint (trainer.save_interval: 0, trainer.save_at_end: false)")
