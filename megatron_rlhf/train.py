"""RL training (PPO, GRPO, RLOO, REINFORCE++): ``torchrun --nproc_per_node=N -m megatron_rlhf.train --config rlhf.yaml [--output-dir DIR]``.

Writes to the output directory: ``metrics.jsonl`` (one object per iteration), ``memory.jsonl``
(the EMS ledger) and TensorBoard events under ``tensorboard/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Optional

from megatron_rlhf.config import ConfigError, input_problems, load_config
from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.dry_run import parse_bytes


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron_rlhf.train", description="PPO training with megatron-core roles and EMS.")
    parser.add_argument("--config", required=True, help="the top config file (rlhf.yaml)")
    parser.add_argument("--output-dir", help="where metrics, the memory ledger and TensorBoard go (default: trainer.output_dir)")
    parser.add_argument("--overwrite", action="store_true", help="replace the metrics of an earlier run in the output directory")
    parser.add_argument("--iterations", type=int, help="override ppo.iterations")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in the output directory (as trainer.resume: auto)")
    dry = parser.add_argument_group("dry run (no torchrun, no GPU: print the resolved config, the layout and memory per role)")
    dry.add_argument("--dry-run", action="store_true", help="print what a launch would do and exit")
    dry.add_argument("--world-size", type=_positive_int, help="processes of the planned launch (default: $WORLD_SIZE, else TP*PP)")
    dry.add_argument("--nproc-per-node", type=_positive_int, help="processes per node (default: $LOCAL_WORLD_SIZE, else the world size)")
    dry.add_argument("--gpu-memory", type=parse_bytes, help="device memory per GPU, e.g. 80GiB: check that the plan fits")
    args = parser.parse_args(argv)
    if not args.dry_run and (args.world_size or args.nproc_per_node or args.gpu_memory):
        parser.error("--world-size, --nproc-per-node and --gpu-memory go with --dry-run (a launch takes them from torchrun)")
    return args


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def _dry_run(args: argparse.Namespace) -> int:
    from megatron_rlhf.dry_run import dry_run

    try:
        world_size = args.world_size or int(os.environ.get("WORLD_SIZE", 0)) or None
        nproc = args.nproc_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None
        return dry_run(args.config, world_size, nproc, args.gpu_memory)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def prepare(args: argparse.Namespace, world_size: int):
    """Everything that can fail on bad input, before any process group or model exists:
    the config, the output directory, the tokenizer, the prompt file and the reward function."""
    from megatron_rlhf.data import PromptDataset, build_tokenizer, read_prompts
    from megatron_rlhf.roles.reward_function import load_reward_function

    config = load_config(args.config, world_size=world_size, check_inputs=False)
    problems = input_problems(config, needs_prompts=True)
    if problems:
        raise ConfigError("missing input:\n  " + "\n  ".join(problems))
    if args.iterations is not None:
        if args.iterations < 1:
            raise ConfigError(f"--iterations: must be >= 1, got {args.iterations}")
        config.ppo.iterations = args.iterations
    output_dir = args.output_dir or config.trainer.output_dir
    if args.resume:
        config.trainer.resume = "auto"
    resume_from = None
    if config.trainer.resume == "auto":
        from megatron_rlhf.checkpoint.ppo_state import latest_checkpoint

        resume_from = latest_checkpoint(output_dir)
    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    if os.path.exists(metrics_path) and not args.overwrite and resume_from is None:
        raise ConfigError(
            f"{metrics_path} exists: {output_dir} already holds a run (and no checkpoint to resume "
            "from); choose another --output-dir or pass --overwrite to replace it"
        )
    tokenizer = build_tokenizer(config.data.tokenizer, config.path_of("data.tokenizer.path"))
    for role in ("policy", "reference", "ppo_policy"):
        model_vocab = config.role(role).model.vocab_size
        if tokenizer.vocab_size > model_vocab:
            raise ConfigError(
                f"{config.source_of(role + '.model')}: {role}.model.vocab_size: {model_vocab} is smaller "
                f"than the tokenizer's vocabulary ({tokenizer.vocab_size}); use at least {tokenizer.vocab_size}"
            )
    prompt_file = config.path_of("data.prompt_file")
    dataset = PromptDataset(read_prompts(prompt_file), tokenizer, config.data.max_prompt_length, config.seed, config.data.shuffle)
    if len(dataset) < config.ppo.rollout_batch_size:
        warnings.warn(f"{prompt_file}: {len(dataset)} prompts, fewer than one rollout batch; prompts repeat within a batch")
    reward_function = None
    if config.reward.type == "function":
        base = os.path.dirname(config.source_of("reward.function"))
        reward_function = load_reward_function(config.reward.function, base)
    return config, output_dir, tokenizer, dataset, reward_function, resume_from


class RunLog:
    """Rank 0's outputs: metrics.jsonl, TensorBoard, the progress bar and one line per iteration."""

    def __init__(self, output_dir: str, config: RLHFConfig, enabled: bool, resumed_at: int = 0):
        self.enabled = enabled
        self.writer = self.bar = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        kept = []  # on resume: the iterations the checkpoint covers; later ones are redone
        if resumed_at and os.path.exists(self.metrics_path):
            with open(self.metrics_path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["iteration"] <= resumed_at]
        with open(self.metrics_path, "w") as f:
            f.writelines(kept)
        if config.trainer.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if config.trainer.progress_bar:
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal (logs, CI); the lines still print.
            self.bar = tqdm(total=config.ppo.iterations, initial=resumed_at, desc="PPO", unit="it",
                            file=sys.stderr, dynamic_ncols=True, disable=None)

    def log(self, metrics: dict, total: int) -> None:
        if not self.enabled:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        step = metrics["iteration"]
        if self.writer is not None:
            for key, value in metrics.items():
                if key != "iteration":
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        parts = [f"iter {step:>4}/{total}", f"reward {metrics['reward/mean']:.3f}", f"kl {metrics['kl/mean']:+.4f}",
                 f"loss/policy {metrics['loss/policy']:+.4f}"]
        if "loss/value" in metrics:  # GAE only
            parts.append(f"loss/value {metrics['loss/value']:.4f}")
        if "sampling/dropped_groups" in metrics:  # dynamic sampling
            parts.append(f"dropped {metrics['sampling/dropped_groups']:.0f}")
        parts += [f"len {metrics['response/length_mean']:.1f}", f"{metrics['time/iteration_s']:.1f}s"]
        line = " | ".join(parts)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def _summary(history: list, seconds: float) -> str:
    rewards = [m["reward/mean"] for m in history]
    k = min(5, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return (
        f"done: {len(history)} iterations in {seconds:.0f}s; mean reward of the first {k} "
        f"{first:.3f}, of the last {k} {last:.3f} ({last - first:+.3f})"
    )


def main(argv=None) -> Optional[list]:
    args = parse_args(argv)
    if not os.environ.get("MEGATRON_RLHF_WARNINGS"):
        # megatron-core and torch warn about fallbacks in their own internals; =1 shows them.
        warnings.simplefilter("ignore", (UserWarning, FutureWarning, DeprecationWarning))
    if args.dry_run:
        sys.exit(_dry_run(args))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config, output_dir, tokenizer, dataset, reward_function, resume_from = prepare(args, world_size)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    import torch.distributed as dist

    from megatron_rlhf.checkpoint.ppo_state import load_ppo_checkpoint, save_ppo_checkpoint
    from megatron_rlhf.controller import PPOController
    from megatron_rlhf.memory import MemoryLedger
    from megatron_rlhf.runtime import destroy_distributed, init_distributed

    init_distributed(config.parallel, seed=config.seed)
    rank0 = dist.get_rank() == 0
    started = time.perf_counter()
    ledger_path = os.path.join(output_dir, "memory.jsonl")
    if rank0 and os.path.exists(ledger_path) and resume_from is None:
        os.remove(ledger_path)  # --overwrite: this run's ledger, not appended to the old one
    controller = PPOController(config, dataset, tokenizer, reward_function, MemoryLedger(ledger_path if rank0 else None))
    if resume_from is not None:
        controller.load_state_dict(load_ppo_checkpoint(controller.roles, resume_from))
        if rank0:
            print(f"resumed from {resume_from} (iteration {controller.iteration})", flush=True)
    log = RunLog(output_dir, config, enabled=rank0, resumed_at=controller.iteration)
    history = []
    interval = config.trainer.save_interval
    try:
        while controller.iteration < config.ppo.iterations:
            metrics = controller.step()
            history.append(metrics)
            log.log(metrics, config.ppo.iterations)
            last = controller.iteration == config.ppo.iterations
            if (interval and controller.iteration % interval == 0) or (last and config.trainer.save_at_end):
                save_ppo_checkpoint(controller.roles, controller.state_dict(), output_dir)
    finally:
        log.close()
    if rank0 and history:
        print(_summary(history, time.perf_counter() - started), flush=True)
        prompt, response = controller.last_samples[0]
        print(f"sample: {prompt!r} -> {response!r}", flush=True)
        ledger = controller.ledger
        print(
            f"memory (rank 0): at most {ledger.peak_resident_bytes() / 2**20:.2f} MiB of role state resident "
            f"at once; {sum(ledger.role_peak_bytes().values()) / 2**20:.2f} MiB if every role stayed resident; ledger in {ledger_path}",
            flush=True,
        )
    destroy_distributed()
    return history


if __name__ == "__main__":
    main()
