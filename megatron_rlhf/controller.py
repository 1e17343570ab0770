"""The PPO controller: one iteration is generate -> score -> advantages -> train -> sync, with
every role brought onto the device only for its phase (EMS). Every rank runs this same loop.

    iteration
      policy     generate responses; log-probs of them (the rollout policy's, "old")
      reference  log-probs (KL penalty)
      reward     scores (scalar head at the last response token, or a rule function)
      value      values of every response position
      ppo math   KL-shaped rewards, GAE, whitening (megatron_rlhf.ppo)
      ppo_policy ppo_epochs x (rollout / global_batch_size) optimizer steps on the clipped surrogate
      ppo_value  the same on the clipped value loss
      sync       trained weights -> policy and value
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf import ppo
from megatron_rlhf.config.schema import SERVED_WEIGHTS, RLHFConfig
from megatron_rlhf.data import PromptDataset, Tokenizer
from megatron_rlhf.generation import SamplingParams, generate
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.models.batches import split_rows
from megatron_rlhf.models.pipeline import sum_over
from megatron_rlhf.roles import Role, build_role
from megatron_rlhf.roles import inference
from megatron_rlhf.roles.losses import policy_loss_fn, reported_metrics, value_loss_fn
from megatron_rlhf.roles.reward_function import RewardFunction, score_with_function
from megatron_rlhf.roles.weight_sync import WeightSync
from megatron_rlhf.runtime.platform import get_platform


@dataclasses.dataclass
class Rollout:
    """This data-parallel rank's share of one iteration's experience. [B, S] tokens; every other
    per-token tensor is [B, S-1] over action positions (see Generated.action_mask)."""

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    action_mask: torch.Tensor
    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    old_values: torch.Tensor
    scores: torch.Tensor  # [B], as the reward gave them
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None


class PPOController:
    def __init__(
        self,
        config: RLHFConfig,
        dataset: PromptDataset,
        tokenizer: Tokenizer,
        reward_function: Optional[RewardFunction],
        ledger: MemoryLedger,
    ):
        from megatron.core import parallel_state as ps

        self.config = config
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.reward_function = reward_function
        self.ledger = ledger
        self.device = get_platform().device
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.vocab_size = tokenizer.vocab_size
        self.sampling = SamplingParams.from_config(config.generation, tokenizer.eos_id, tokenizer.pad_id)
        self.roles: Dict[str, Role] = {}
        for name in config.model_roles:
            self.roles[name] = build_role(name, config)
            ledger.track(self.roles[name].memory)
        self.syncs = [
            WeightSync(self.roles[trained], self.roles[serving], share=config.weight_owner(serving) is not None)
            for serving, trained in SERVED_WEIGHTS.items()
        ]
        p = config.ppo
        self.kl_controller = (
            ppo.AdaptiveKLController(p.kl_coef, p.kl_target, p.kl_horizon) if p.adaptive_kl else ppo.FixedKLController(p.kl_coef)
        )
        self.score_moments = ppo.RunningMoments()
        self.iteration = 0

    # -- one iteration -------------------------------------------------------------------------

    def step(self) -> Dict[str, float]:
        """Run the next iteration; returns its metrics (the same on every rank)."""
        self.iteration += 1
        self.ledger.iteration = self.iteration
        start = time.perf_counter()
        rollout, texts, generate_s = self._rollout()
        shaped = self._advantages(rollout)
        train_metrics = self._train(rollout)
        for sync in self.syncs:
            sync()
        self.ledger.record("phase_end", "iteration")
        metrics = {
            "reward/mean": rollout.scores.mean().item(),
            "reward/std": rollout.scores.std().item() if len(rollout.scores) > 1 else 0.0,
            **shaped,
            **train_metrics,
            "response/length_mean": rollout.response_lengths.float().mean().item(),
        }
        metrics = self._dp_mean(metrics)
        if isinstance(self.kl_controller, ppo.AdaptiveKLController):
            self.kl_controller.update(metrics["kl/sequence_mean"], self.config.ppo.rollout_batch_size)
        end = time.perf_counter()
        metrics["time/generate_s"] = generate_s
        metrics["time/iteration_s"] = end - start
        self.last_samples = texts
        return {"iteration": self.iteration, **metrics}

    # -- resumable state ----------------------------------------------------------------------

    def state_dict(self) -> Dict:
        """Everything besides the trained roles that the next iteration depends on."""
        return {
            "iteration": self.iteration,
            "kl_coef": self.kl_controller.value,
            "score_moments": self.score_moments.state_dict(),
            "dataset": self.dataset.state_dict(),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        }

    def load_state_dict(self, state: Dict) -> None:
        self.iteration = self.ledger.iteration = state["iteration"]
        self.kl_controller.value = state["kl_coef"]
        self.score_moments.load_state_dict(state["score_moments"])
        self.dataset.load_state_dict(state["dataset"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])

    def _rollout(self):
        cfg = self.config
        batch = self.dataset.next_batch(cfg.ppo.rollout_batch_size, self.dp_rank, self.dp_size)
        # One stream per data-parallel replica, alike on its TP and PP ranks.
        generator = torch.Generator(device=self.device).manual_seed(
            cfg.seed * 1_000_003 + self.iteration * 1_009 + self.dp_rank
        )
        policy, temperature = self.roles["policy"], cfg.generation.temperature
        with policy.resident("inference"):
            started = time.perf_counter()
            gen = generate(
                policy.model, batch["tokens"].to(self.device), batch["lengths"], self.sampling, self.vocab_size, generator,
                batch_size=cfg.generation.batch_size,
            )
            generate_s = time.perf_counter() - started
            old_log_probs = inference.log_probs(policy, gen.tokens, self.vocab_size, temperature)
        with self.roles["reference"].resident("inference"):
            ref_log_probs = inference.log_probs(self.roles["reference"], gen.tokens, self.vocab_size, temperature)
        responses = [
            self.tokenizer.decode(row[p : p + r].tolist())
            for row, p, r in zip(gen.tokens.cpu(), gen.prompt_lengths.tolist(), gen.response_lengths.tolist())
        ]
        if self.reward_function is not None:
            scores = score_with_function(self.reward_function, batch["texts"], responses).to(self.device)
        else:
            last = (gen.total_lengths - 1).clamp(min=0)
            with self.roles["reward"].resident("inference"):
                scores = inference.scores(self.roles["reward"], gen.tokens, last)
        with self.roles["value"].resident("inference"):
            old_values = inference.values(self.roles["value"], gen.tokens)
        rollout = Rollout(
            gen.tokens, gen.prompt_lengths, gen.response_lengths, gen.action_mask(),
            old_log_probs, ref_log_probs, old_values, scores,
        )
        return rollout, list(zip(batch["texts"], responses)), generate_s

    def _advantages(self, r: Rollout) -> Dict[str, float]:
        """Fill r.advantages and r.returns; returns the KL metrics."""
        p = self.config.ppo
        mask = r.action_mask
        kl = ppo.kl_penalty(r.old_log_probs, r.ref_log_probs, p.kl_estimator) * mask
        scores = ppo.clip_rewards(r.scores, p.reward_clip)
        if p.normalize_reward:
            # Every score of the rollout, in DP-rank order: the moments are the same on every rank.
            self.score_moments.update(self._gather_over_dp(scores))
            scores = scores / (self.score_moments.std + 1e-8)
        rewards = ppo.token_rewards(scores, kl, self.kl_controller.value, mask)
        advantages, r.returns = ppo.gae_advantages(rewards, r.old_values, mask, p.gamma, p.lam)
        if p.whiten_advantages:  # by the statistics of the whole rollout, not this rank's share
            moments = sum_over(ppo.masked_moments(advantages, mask), self.dp_group)
            advantages = ppo.whiten_with_moments(advantages, mask, moments)
        r.advantages = advantages
        return {
            "kl/mean": ppo.masked_mean(kl, mask).item(),
            "kl/sequence_mean": kl.sum(dim=1).mean().item(),
            "kl/coef": self.kl_controller.value,
            "returns/mean": ppo.masked_mean(r.returns, mask).item(),
            "values/mean": ppo.masked_mean(r.old_values, mask).item(),
        }

    def _train(self, r: Rollout) -> Dict[str, float]:
        cfg = self.config
        policy_columns = dict(tokens=r.tokens, action_mask=r.action_mask, old_log_probs=r.old_log_probs, advantages=r.advantages)
        value_columns = dict(tokens=r.tokens, action_mask=r.action_mask, old_values=r.old_values, returns=r.returns)
        mode = cfg.ppo.loss_agg_mode
        policy_loss = policy_loss_fn(self.vocab_size, cfg.generation.temperature, cfg.ppo.clip_ratio, mode)
        out = {}
        start = time.perf_counter()
        out.update(self._train_role("ppo_policy", policy_columns, policy_loss, "policy"))
        out.update(self._train_role("ppo_value", value_columns, value_loss_fn(cfg.ppo.value_clip, mode), "value"))
        out["time/train_s"] = time.perf_counter() - start
        return out

    def _train_role(self, name: str, columns: Dict[str, torch.Tensor], loss_fn, prefix: str) -> Dict[str, float]:
        cfg = self.config
        role = self.roles[name]
        rows = columns["tokens"].shape[0]
        step_rows = cfg.samples_per_step(name) // self.dp_size
        steps: List[List[Dict[str, torch.Tensor]]] = []  # per optimizer step, its micro-batches' metric sums
        grad_norms = []
        with role.resident("training"):
            for epoch in range(cfg.ppo.ppo_epochs):
                # The same order on every rank of this replica (its TP and PP ranks must agree).
                order = torch.randperm(rows, generator=torch.Generator().manual_seed(
                    cfg.seed + 7_919 * self.iteration + 104_729 * epoch)).to(columns["tokens"].device)
                for first in range(0, rows, step_rows):
                    picked = order[first : first + step_rows]
                    mbs = split_rows(role.config.micro_batch_size, **{k: v[picked] for k, v in columns.items()})
                    result = role.train_step(mbs, loss_fn)
                    steps.append(result["metrics"])
                    grad_norms.append(float(result["grad_norm"]))
        metrics = reported_metrics(steps, prefix, self.device, self.dp_group)
        return {**metrics, f"{prefix}/grad_norm": sum(grad_norms) / len(grad_norms)}

    def _gather_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's [n] share of a DP-split tensor -> the whole [n * DP], in DP-rank order."""
        if self.dp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.dp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.dp_group)
        return torch.cat(parts)

    def _dp_mean(self, metrics: Dict[str, float]) -> Dict[str, float]:
        if self.dp_size == 1:
            return metrics
        keys = sorted(metrics)
        values = sum_over(torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device), self.dp_group)
        return {k: v / self.dp_size for k, v in zip(keys, values.tolist())}
