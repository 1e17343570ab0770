"""Rank 0's outputs of a run, any stage: metrics.jsonl (one object per iteration or optimizer
step), samples.jsonl, TensorBoard, Weights & Biases, the progress bar and the printed lines
(RunLog); RL's lines and end-of-run summary."""

from __future__ import annotations

import json
import math
import os
import sys

from megatron_rlhf.checkpoint.run_state import cut_back, run_identity
from megatron_rlhf.config.schema import RLHFConfig


class RunLog:
    """Rank 0's outputs: metrics.jsonl, TensorBoard, the progress bar and one line per iteration.
    ``total``: the run's iterations (the bar's end), ``label``: the bar's name."""

    def __init__(self, output_dir: str, config: RLHFConfig, enabled: bool, total: int, label: str, resumed_at: int = 0):
        self.enabled = enabled
        self.writer = self.bar = self.wandb = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(output_dir, "samples.jsonl")
        # On resume: the iterations the checkpoint covers; later ones are redone.
        cut_back(self.metrics_path, resumed_at)
        cut_back(self.samples_path, resumed_at)
        if config.trainer.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if config.trainer.wandb:
            import wandb

            self.wandb = wandb.init(project=config.trainer.wandb_project, name=config.trainer.wandb_run_name,
                                    dir=output_dir, config=run_identity(config)["config"], resume="allow")
        if config.trainer.progress_bar:
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal (logs, CI); the lines still print.
            self.bar = tqdm(total=total, initial=resumed_at, desc=label, unit="it",
                            file=sys.stderr, dynamic_ncols=True, disable=None)

    def record(self, metrics: dict) -> None:
        """One metrics.jsonl line (strict JSON: a non-finite figure, a skipped step's loss, is
        written as null) and the TensorBoard scalars."""
        finite = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in metrics.items()}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(finite, allow_nan=False) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if key != "iteration" and finite[key] is not None:
                    self.writer.add_scalar(key, value, metrics["iteration"])
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in finite.items() if k != "iteration" and v is not None}, step=metrics["iteration"])

    def step(self, metrics: dict, line: str, samples: list = ()) -> None:
        """One step: metrics.jsonl (and TensorBoard, W&B), samples.jsonl (a few rows: prompt,
        response, score, ground truth), the printed line."""
        if not self.enabled:
            return
        self.record(metrics)
        if samples:
            with open(self.samples_path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps({"iteration": metrics["iteration"], **s}, default=str) + "\n" for s in samples)
        self.write(line, 1)

    def write(self, line: str, advance: int) -> None:
        if self.bar is not None:
            self.bar.update(advance)
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def rl_label(config: RLHFConfig) -> str:
    """An RL run's name on the progress bar: its estimator (PPO for GAE)."""
    return config.algorithm.advantage_estimator.upper().replace("_PLUS_PLUS", "++").replace("GAE", "PPO")


def rl_line(metrics: dict) -> list:
    """An RL iteration's printed figures: reward, KL, losses, what the run has (dynamic sampling,
    reward failures, turns, tools), length, time and validation's."""
    parts = [f"reward {metrics['reward/mean']:.3f}", f"kl {metrics['kl/mean']:+.4f}",
             f"loss/policy {metrics['loss/policy']:+.4f}"]
    if "loss/value" in metrics:  # GAE only
        parts.append(f"loss/value {metrics['loss/value']:.4f}")
    if "sampling/dropped_groups" in metrics:  # dynamic sampling
        parts.append(f"dropped {metrics['sampling/dropped_groups']:.0f}")
    if metrics.get("reward/failures"):
        failing = [k.split("/")[1] for k, v in metrics.items() if k.startswith("reward/") and k.endswith("/failures")
                   and k.count("/") == 2 and v]
        parts.append(f"reward failures {metrics['reward/failures']:.0f}" + (f" ({', '.join(failing)})" if failing else ""))
    if "rollout/turns_mean" in metrics:  # multi-turn
        parts += [f"turns {metrics['rollout/turns_mean']:.1f}", f"env failures {metrics['rollout/env_failures']:.0f}",
                  f"masked {1 - metrics['rollout/model_token_share']:.0%}"]
    if "rollout/tool_calls" in metrics:  # tools
        parts.append(f"tool calls {metrics['rollout/tool_calls']:.0f} ({metrics['rollout/tool_errors']:.0f} errors)")
    parts += [f"len {metrics['response/length_mean']:.1f}", f"{metrics['time/iteration_s']:.1f}s"]
    return parts + validation_parts(metrics)


def validation_parts(metrics: dict) -> list:
    """``val reward R | val pass@k P`` of the metrics that have validation's figures."""
    passes = [k for k in metrics if k.startswith("val/pass@")]
    if not passes:
        return []
    parts = [f"val reward {metrics['val/reward/mean']:.3f}", f"{passes[0]} {metrics[passes[0]]:.3f}"]
    if metrics.get("val/reward/failures"):
        parts.append(f"val reward failures {metrics['val/reward/failures']:.0f}")
    return parts


def validation_summary(first: dict, last: dict) -> str:
    passes = next(k for k in first if k.startswith("val/pass@"))
    return (f"validation: reward {first['val/reward/mean']:.3f} -> {last['val/reward/mean']:.3f}, "
            f"{passes[4:]} {first[passes]:.3f} -> {last[passes]:.3f}")


def run_summary(history: list, seconds: float) -> str:
    rewards = [m["reward/mean"] for m in history]
    k = min(5, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return (
        f"done: {len(history)} iterations in {seconds:.0f}s; mean reward of the first {k} "
        f"{first:.3f}, of the last {k} {last:.3f} ({last - first:+.3f})"
    )


def rl_summary(history: list, seconds: float, validations: list, samples: list) -> list:
    """The lines that end an RL run: the reward's change, validation's, a sample."""
    lines = [run_summary(history, seconds)]
    if len(validations) > 1:
        lines.append(validation_summary(validations[0], validations[-1]))
    if samples:
        lines.append(f"sample: {samples[0]['prompt']!r} -> {samples[0]['response']!r}")
    return lines
