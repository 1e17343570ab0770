"""Rank 0's outputs of a run, any stage: metrics.jsonl (one object per iteration or optimizer
step), TensorBoard, Weights & Biases, the progress bar and the printed lines."""

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
