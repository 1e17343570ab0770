"""The RL controller: one iteration reads top to bottom (collect, advantages, train, sync), every
role brought onto the device only for its phase (EMS). Every rank runs this same loop.

    iteration
      collect    the policy answers samples_per_prompt times per prompt (one turn, or turns with an
                 environment; [partial rollouts: over-sampled, the groups not ended held for the
                 next iteration]) and scores its tokens ("old"); the reward scores each response
                 [and the judge: its verdicts' weighted scores added]
                 [dynamic sampling: drop groups that all score the same, generate more];
                 the reference's log-probs, the value model's values (GAE only)   (rollout/)
      advantages GAE, GRPO, RLOO or REINFORCE++, and [rollout correction] the weights of the
                 behaviour policy's tokens (megatron_rlhf.ppo)
      train      ppo_policy (and ppo_value) for ppo_epochs passes of optimizer steps   (roles/update.py)
      sync       trained weights -> policy (and value)                              (roles/role_set.py)
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_rlhf import ppo
from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.data import PromptDataset, Tokenizer
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.models.pipeline import sum_over
from megatron_rlhf.rewards.pool import RewardPool
from megatron_rlhf.roles.role_set import Progress, RoleSet
from megatron_rlhf.roles.update import PPOUpdate
from megatron_rlhf.rollout.collector import RolloutCollector
from megatron_rlhf.rollout.judging import Judge
from megatron_rlhf.rollout.record import Rollout, is_counted
from megatron_rlhf.rollout.scoring import Scorer, rule_reward_pool
from megatron_rlhf.rollout.validation import Validator
from megatron_rlhf.run_log import rl_label, rl_line, rl_summary, validation_parts
from megatron_rlhf.runtime.host_groups import host_group
from megatron_rlhf.stages.steps import Steps


class PPOController(Steps):
    """RL as a stage of the run loop (stages/steps.py): a step is one iteration."""

    noun, unit = "iteration", "iter"

    def __init__(
        self,
        config: RLHFConfig,
        dataset: PromptDataset,
        tokenizer: Tokenizer,
        reward_pool: Optional[RewardPool],
        ledger: MemoryLedger,
        overlap_budget: Optional[int] = None,
        val_dataset: Optional[PromptDataset] = None,
        progress_dir: Optional[str] = None,
        turns=None,
    ):
        """``reward_pool``: the rule rewards' workers on the first rank of each model-parallel
        group (None elsewhere and with a reward model). ``overlap_budget``: device bytes free at
        start-up (roles/role_set.py). ``progress_dir``: where each rank records its phase.
        ``turns``: the multi-turn runner (rollout/multiturn.py), None for single responses."""
        self.config = config
        self.dataset = dataset
        self.ledger = ledger
        self.progress = Progress(progress_dir)
        self.role_set = RoleSet(config, ledger, tokenizer.pad_id, overlap_budget, self.progress)
        self.roles = self.role_set.roles
        judge = Judge(config, self.role_set, tokenizer) if "judge" in self.roles else None
        self.collector = RolloutCollector(config, self.role_set, tokenizer,
                                          Scorer(config, self.role_set, reward_pool, judge, tokenizer), turns)
        self.validator = Validator(self.collector, val_dataset) if val_dataset is not None else None
        self.update = PPOUpdate(config, self.role_set, tokenizer.vocab_size, tokenizer.pad_id)
        p = config.ppo
        self.kl_controller = (
            ppo.AdaptiveKLController(p.kl_coef, p.kl_target, p.kl_horizon) if p.adaptive_kl else ppo.FixedKLController(p.kl_coef)
        )
        self.score_moments = ppo.RunningMoments()
        self.iteration = 0
        self.samples = []  # a few rows of the latest rollout: prompt, response, score, ground truth
        self.total, self.validates = config.ppo.iterations, self.validator is not None
        self.label = rl_label(config)
        self.reward_pool, self.turns = reward_pool, turns

    @classmethod
    def for_run(cls, prepared, ledger: MemoryLedger, progress_dir: str, overlap_budget: Optional[int]) -> "PPOController":
        """With the rule rewards' pool and the multi-turn runner (with an environment): close() ends both."""
        from megatron_rlhf.rollout.multiturn import MultiTurn

        config = prepared.config
        turns = None if prepared.environment is None else \
            MultiTurn(config, prepared.tokenizer, prepared.environment, config.data.apply_chat_template)
        return cls(config, prepared.dataset, prepared.tokenizer, rule_reward_pool(config, prepared.reward_functions),
                   ledger, overlap_budget, prepared.val_dataset, progress_dir, turns)

    def close(self) -> None:
        for started in filter(None, (self.reward_pool, self.turns, self.collector.scorer.judge)):
            started.close()

    def _mark(self, phase: str) -> None:
        self.progress.iteration = self.iteration
        self.progress.mark(phase)

    # -- one iteration -------------------------------------------------------------------------

    def step(self, iteration: Optional[int] = None) -> Dict[str, float]:
        """Run the next iteration (``iteration``, when given, says which it is); returns its
        metrics (the same on every rank)."""
        assert iteration in (None, self.iteration + 1), (iteration, self.iteration)
        self.iteration += 1
        self.ledger.iteration = self.iteration
        self._mark("rollout")
        collected = self.collector.collect(self.dataset, self.iteration)
        rollout = collected.rollout
        self._mark("advantages")
        shaped = self._advantages(rollout)
        train_metrics = self.update(rollout, self.iteration, self.kl_controller.value)
        self._mark("weight sync")
        started = time.perf_counter()
        synced_bytes = self.role_set.sync()
        sync_s = time.perf_counter() - started
        self.ledger.record("phase_end", "iteration")
        collect_metrics = dict(collected.metrics)
        generate_s = collect_metrics.pop("time/generate_s")
        metrics = {**shaped, **train_metrics, **collect_metrics}
        self._mark("metrics")
        metrics = self._dp_mean(metrics)
        if isinstance(self.kl_controller, ppo.AdaptiveKLController):
            self.kl_controller.update(metrics["kl/sequence_mean"], self.config.rollout_samples)  # responses, as verl counts them
        metrics["time/generate_s"] = generate_s
        metrics["time/weight_sync_s"], metrics["weight_sync/bytes"] = sync_s, float(synced_bytes)
        self.samples = collected.samples
        return {"iteration": self.iteration, **metrics}

    def validate(self) -> Dict[str, float]:
        """The validation metrics of the current policy (rollout/validation.py)."""
        return self.validator.validate(self.iteration)

    # -- what the run prints ---------------------------------------------------------------------

    line, validation_line = staticmethod(rl_line), staticmethod(validation_parts)

    def summary(self, history: List[Dict[str, float]], seconds: float, validations: List[Dict[str, float]]) -> List[str]:
        return rl_summary(history, seconds, validations, self.samples)

    # -- resumable state ----------------------------------------------------------------------

    def state_dict(self) -> Dict:
        """Everything besides the trained roles and the random state that the next iteration depends on."""
        return {
            "kl_coef": self.kl_controller.value,
            "score_moments": self.score_moments.state_dict(),
            "dataset": self.dataset.state_dict(),
            "partial": self.collector.partial.state_dict() if self.collector.partial is not None else None,
        }

    def load_state_dict(self, state: Dict, iteration: int) -> None:
        """Continue after ``iteration`` from ``state`` (the trained roles restored by the run
        loop): the serving roles that copy or reshard their weights are served the restored ones
        (those sharing storage already run on them)."""
        self.role_set.sync(whole=True)
        self.iteration = self.ledger.iteration = iteration
        self.kl_controller.value = state["kl_coef"]
        self.score_moments.load_state_dict(state["score_moments"])
        self.dataset.load_state_dict(state["dataset"])
        if self.collector.partial is not None:
            self.collector.partial.load_state_dict(state.get("partial") or {"held": None})

    # -- advantages and metrics ----------------------------------------------------------------

    def _advantages(self, r: Rollout) -> Dict[str, float]:
        """Fill r.advantages (and, for GAE, r.returns) by the configured estimator; returns the KL
        metrics. Whitening and reward moments use the whole rollout (every DP rank's rows)."""
        p, alg = self.config.ppo, self.config.algorithm
        mask = r.action_mask
        kl = ppo.kl_penalty(r.old_log_probs, r.ref_log_probs, p.kl_estimator) * mask
        scores = ppo.clip_rewards(r.scores, p.reward_clip)
        if p.normalize_reward:
            # Every score of the rollout, in DP-rank order: the moments are the same on every rank.
            self.score_moments.update(self.role_set.cut.gather_tensor(scores))
            scores = scores / (self.score_moments.std + 1e-8)
        rewards = ppo.token_rewards(scores, kl, 0.0 if p.kl_in_loss else self.kl_controller.value, mask, r.step_rewards)
        estimator = ppo.ESTIMATORS[alg.advantage_estimator]
        advantages, r.returns = estimator.advantages(ppo.EstimatorInputs(
            rewards, mask, r.old_values, r.group_index, p.gamma, p.lam, alg.norm_adv_by_std_in_grpo))
        if estimator.whitened(p.whiten_advantages):  # by the statistics of the whole rollout, not this rank's share
            moments = sum_over(ppo.masked_moments(advantages, mask), self.role_set.cut.group)
            advantages = ppo.whiten_with_moments(advantages, mask, moments)
        r.advantages = advantages
        return {"kl/coef": self.kl_controller.value, **self._rollout_figures(r, kl, self._correct(r))}

    def _correct(self, r: Rollout) -> Dict[str, tuple]:
        """Where the engine's log-probs were recorded: r.correction (the policy loss's token weights
        and mask, algorithm.rollout_correction) and the mismatch figures' sums."""
        if r.behaviour_log_probs is None:
            return {}
        c = self.config.algorithm.rollout_correction
        r.correction = ppo.rollout_correction(r.old_log_probs, r.behaviour_log_probs, r.action_mask, c.mode, c.level, c.band)
        return ppo.mismatch_figures(r.old_log_probs, r.behaviour_log_probs, r.action_mask, r.correction)

    def _rollout_figures(self, r: Rollout, kl: torch.Tensor, more: Dict[str, tuple]) -> Dict[str, float]:
        """The rollout's figures over every DP rank's rows, from sums over the ranks: a token mean
        weighs every token alike, the reward's std is the whole rollout's, whatever each share holds.
        ``more``: further figures as (numerator, denominator) of this rank's share."""
        mask, rows = r.action_mask, float(len(r.scores))
        tokens = mask.sum()
        ratios = {  # figure: (numerator, denominator) summed over the ranks
            "reward/mean": (r.scores.sum(), rows),
            "reward/square_mean": (r.scores.double().pow(2).sum(), rows),
            "kl/mean": ((kl * mask).sum(), tokens),
            "kl/sequence_mean": (kl.sum(), rows),
            "advantages/abs_mean": ((r.advantages.abs() * mask).sum(), tokens),
            "response/length_mean": (r.response_lengths.sum(), rows),
        }
        if r.returns is not None:
            ratios["returns/mean"] = ((r.returns * mask).sum(), tokens)
            ratios["values/mean"] = ((r.old_values * mask).sum(), tokens)
        ratios.update(more)
        sums = sum_over(torch.tensor([[float(n), float(d)] for n, d in ratios.values()], dtype=torch.float64,
                                     device=mask.device), self.role_set.cut.group)
        out = {k: (n / d if d else 0.0) for k, (n, d) in zip(ratios, sums.tolist())}
        n = sums[0, 1].item()
        variance = (out.pop("reward/square_mean") - out["reward/mean"] ** 2) * n / (n - 1) if n > 1 else 0.0
        out["reward/std"] = max(variance, 0.0) ** 0.5
        return out

    def _dp_mean(self, metrics: Dict[str, float]) -> Dict[str, float]:
        """The mean over DP ranks (equal shares of the rollout), the sum for counts. A metric only
        some ranks have (a reward's sub-score where every call of it failed) is the mean of those."""
        if self.role_set.cut.size == 1:
            return metrics
        names = [None] * self.role_set.cut.size
        dist.all_gather_object(names, sorted(metrics), group=host_group(self.role_set.cut.group))
        keys = sorted(set().union(*names))
        local = torch.tensor([[metrics.get(k, 0.0), float(k in metrics)] for k in keys], dtype=torch.float64,
                             device=self.collector.device)
        totals = sum_over(local, self.role_set.cut.group).tolist()
        return {k: v if is_counted(k) else v / present for k, (v, present) in zip(keys, totals)}
