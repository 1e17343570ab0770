"""Validation: responses to every validation prompt (trainer.val_samples_per_prompt each, greedy or
sampled as in training, each from its own stream), through the same collector as the rollout's
(one turn, or trajectories with the environment), scored like the rollout's."""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch.distributed as dist

from megatron_rlhf.data import PromptDataset
from megatron_rlhf.rollout.collector import RolloutCollector
from megatron_rlhf.rollout.record import Prompts
from megatron_rlhf.roles.rows import RowCut
from megatron_rlhf.runtime.host_groups import host_group

SCORED_COLUMNS = ("tokens", "prompt_lengths", "response_lengths", "action_mask", "turn_rewards")
VALIDATION_STREAM = -1  # the iteration key of validation's sampling streams (training's are >= 1)


class Validator:
    def __init__(self, collector: RolloutCollector, dataset: PromptDataset):
        self.collector = collector
        self.dataset = dataset

    def validate(self, iteration: int) -> Dict[str, float]:
        """val/reward/mean, val/mean@k (the mean score), val/pass@k (the share of prompts with a
        response that scores at least 1, a verifier's "correct"), overall and per data_source. The
        same on every rank."""
        collector, roles = self.collector, self.collector.roles
        cfg = collector.config
        k = cfg.trainer.val_samples_per_prompt
        sampling = dataclasses.replace(collector.sampling, greedy=cfg.trainer.val_greedy)
        cut = roles.cuts["policy"]  # generated in the policy's cut, scored in the run's
        mine = self.dataset.usable_indices()[cut.rank :: cut.size]
        chunk = max(1, cfg.ppo.rollout_batch_size // cut.size)
        generated = []
        with roles.resident("policy", "inference"):
            for start in range(0, len(mine), chunk):
                batch = self.dataset.batch_of(mine[start : start + chunk])
                prompts = Prompts.expand(batch, k, cfg.seed, VALIDATION_STREAM, 0, collector.device)
                rows, _ = collector.generate(prompts.columns(), prompts, sampling)
                generated.append((batch, {key: v for key, v in rows.items() if key in SCORED_COLUMNS}))
        if cut != roles.cut:
            generated = _chunks_in_run_cut(generated, cut, roles.cut, collector.device)
        results, failures = [], []  # (data source, scores of the prompt's k responses); failed reward calls
        for batch, rows in generated:  # scored once the policy has left (a reward model may need the room)
            prompts = [t for t in batch["texts"] for _ in range(k)]
            fields = [f for f in batch["fields"] for _ in range(k)]
            scores, scored = collector.scorer.score(prompts, collector.decode(rows), fields, rows, iteration)
            failures.append(scored.get("reward/failures", 0.0))
            scores = scores.view(len(batch["texts"]), k).cpu()
            results += [(str(f.get("data_source") or ""), s.tolist()) for f, s in zip(batch["fields"], scores)]
        gathered = [None] * roles.cut.size
        dist.all_gather_object(gathered, (results, sum(failures)), group=host_group(roles.cut.group))
        metrics = validation_metrics([r for part, _ in gathered for r in part], k)
        if collector.config.reward.type == "function":  # one rank per replica in the DP group: each counted once
            metrics["val/reward/failures"] = float(sum(f for _, f in gathered))
        return metrics


def _chunks_in_run_cut(generated: List, cut: RowCut, run_cut: RowCut, device) -> List:
    """Validation's (batch, rows) chunks generated in ``cut`` -> this rank's chunks in the run's
    cut (every chunk of every rank of ``cut`` gathered, every run DP rank taking its turn)."""
    local = [(batch, {k: v.cpu() for k, v in rows.items()}) for batch, rows in generated]
    gathered = [None] * cut.size
    dist.all_gather_object(gathered, local, group=host_group(cut.group))
    chunks = [c for part in gathered for c in part][run_cut.rank :: run_cut.size]
    return [(batch, {k: v.to(device) for k, v in rows.items()}) for batch, rows in chunks]


def validation_metrics(results: List, k: int) -> Dict[str, float]:
    """val/reward/mean, val/mean@k and val/pass@k over (data source, k scores) per prompt, and the
    same per data source (val/<source>/...) for the rows that name one."""
    def summary(rows, prefix):
        scores = [s for _, row in rows for s in row]
        return {f"{prefix}reward/mean": sum(scores) / len(scores), f"{prefix}mean@{k}": sum(scores) / len(scores),
                f"{prefix}pass@{k}": sum(max(row) >= 1.0 for _, row in rows) / len(rows)}

    metrics = summary(results, "val/")
    sources = sorted({source for source, _ in results if source})
    for source in sources:
        metrics.update(summary([r for r in results if r[0] == source], f"val/{source}/"))
    return metrics
