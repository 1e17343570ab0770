"""The RL controller: one iteration is generate -> score -> advantages -> train -> sync, with
every role brought onto the device only for its phase (EMS). Every rank runs this same loop.

    iteration
      policy     generate samples_per_prompt responses per prompt; their log-probs ("old")
      reward     scores (scalar head at the last response token, or a rule function)
                 [dynamic sampling: drop groups that all score the same, generate more]
      reference  log-probs (KL penalty, in the reward or in the loss)
      value      values of every response position (GAE only)
      advantages GAE, GRPO, RLOO or REINFORCE++ (megatron_rlhf.ppo)
      ppo_policy ppo_epochs x (rollout / global_batch_size) optimizer steps on the clipped surrogate
      ppo_value  the same on the clipped value loss (GAE only)
      sync       trained weights -> policy (and value)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf import ppo
from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.data import PromptDataset, Tokenizer
from megatron_rlhf.errors import NonFiniteError, RewardFunctionError
from megatron_rlhf.generation import SamplingParams, generate, stream_seeds
from megatron_rlhf.memory import KV_CACHE, MemoryLedger
from megatron_rlhf.models.batches import action_mask, length_grouped
from megatron_rlhf.models.decoder import groups_of
from megatron_rlhf.models.pipeline import sum_over
from megatron_rlhf.models.routing import ROUTES
from megatron_rlhf.roles import Role, build_role
from megatron_rlhf.roles import inference
from megatron_rlhf.roles.losses import policy_loss_fn, policy_stats, reported_metrics, value_loss_fn
from megatron_rlhf.rewards.pool import RewardPool, check_scores
from megatron_rlhf.roles.weight_sync import WeightSync
from megatron_rlhf.rollout_rows import RowCut, SampleRows, cat_rows, recut, trimmed
from megatron_rlhf.runtime.platform import get_platform



@dataclasses.dataclass
class Rollout:
    """This data-parallel rank's share of one iteration's experience. [B, S] tokens; every other
    per-token tensor is [B, S-1] over action positions (see Generated.action_mask). The responses
    to one prompt are adjacent rows; ``group_index`` [B] numbers those groups."""

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    action_mask: torch.Tensor
    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    scores: torch.Tensor  # [B], as the reward gave them (plus any overlong penalty)
    group_index: torch.Tensor
    old_values: Optional[torch.Tensor] = None  # GAE only
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None  # GAE only
    routes: Optional[torch.Tensor] = None  # [B, S, L, K], routing replay's record (models/routing.py)


class PPOController:
    def __init__(
        self,
        config: RLHFConfig,
        dataset: PromptDataset,
        tokenizer: Tokenizer,
        reward_scorer: Optional[RewardPool],
        ledger: MemoryLedger,
        overlap_budget: Optional[int] = None,
        val_dataset: Optional[PromptDataset] = None,
    ):
        """``overlap_budget``: device bytes free at start-up; with it, each next role's onload
        overlaps the current role's phase where the planner says both fit in it."""
        from megatron.core import parallel_state as ps

        self.config = config
        self.dataset, self.val_dataset = dataset, val_dataset
        self.tokenizer = tokenizer
        # Rule rewards (used on the first rank of each model-parallel group); None: the reward model.
        self.reward_scorer = reward_scorer
        self.ledger = ledger
        self.device = get_platform().device
        # The rollout's rows are held in the run's cut (its DP ranks); a role of its own layout
        # gets them in its own cut for its phase (rollout_rows.recut).
        self.cut = RowCut.of(ps.get_data_parallel_group())
        self.vocab_size = tokenizer.vocab_size
        self.sampling = SamplingParams.from_config(config.generation, tokenizer.eos_ids, tokenizer.pad_id)
        self.roles: Dict[str, Role] = {}
        for name in config.model_roles:
            self.roles[name] = build_role(name, config)
            ledger.track(self.roles[name].memory)
        self.cuts = {name: RowCut.of(groups_of(role.model).dp) if config.has_own_layout(name) else self.cut
                     for name, role in self.roles.items()}
        self.overlaps = self._overlaps(overlap_budget) if overlap_budget is not None else {}
        self.syncs = [
            WeightSync(self.roles[trained], self.roles[serving], share=config.weight_owner(serving) is not None,
                       reshard=config.has_own_layout(serving))
            for serving, trained in config.served_weights.items()
        ]
        p = config.ppo
        self.kl_controller = (
            ppo.AdaptiveKLController(p.kl_coef, p.kl_target, p.kl_horizon) if p.adaptive_kl else ppo.FixedKLController(p.kl_coef)
        )
        self.score_moments = ppo.RunningMoments()
        self.iteration = 0
        # Where each rank is (iteration, phase), one small file per rank under ``progress_dir`` when
        # set: a rank that times out in a collective names the ranks that are elsewhere.
        self.progress_dir: Optional[str] = None
        self.phase = "start-up"

    @property
    def phase(self) -> str:
        """What the controller is doing now (a role's phase, "advantages", "metrics", ...)."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        if self.progress_dir is not None:
            with open(os.path.join(self.progress_dir, f"rank{dist.get_rank()}"), "w", encoding="utf-8") as f:
                f.write(f"{self.iteration}\t{value}\t{time.time():.0f}")

    def _overlaps(self, budget: int) -> Dict[str, str]:
        """The successions whose onload may overlap (both phases fit in ``budget``), printed on rank 0."""
        from megatron_rlhf.units import human
        from megatron_rlhf.memory.planner import overlap_fits, plan

        planned = plan(self.config, dist.get_world_size())
        pairs = {a: b for a, b in self.config.successions.items() if overlap_fits(self.config, planned, a, b, budget)}
        if dist.get_rank() == 0:
            print(f"overlap_onload: {human(budget)} free on the device; overlapping "
                  f"{', '.join(f'{a} -> {b}' for a, b in pairs.items()) or 'nothing'}", flush=True)
        return pairs

    @contextlib.contextmanager
    def _resident(self, name: str, phase: str):
        """``name`` on the device for ``phase``; where the role that runs next may overlap, its
        onload starts as soon as this role is on the device."""
        self.phase = f"{name} ({phase})"
        with self.roles[name].resident(phase):
            following = self.overlaps.get(name)
            if following is not None:
                self.roles[following].memory.prefetch("training" if self.roles[following].trainable else "inference")
            yield

    # -- one iteration -------------------------------------------------------------------------

    def step(self) -> Dict[str, float]:
        """Run the next iteration; returns its metrics (the same on every rank)."""
        self.iteration += 1
        self.ledger.iteration = self.iteration
        start = time.perf_counter()
        self.reward_metrics: List[Dict[str, float]] = []
        self.phase = "rollout"
        rollout, texts, sampling = self._rollout()
        self.phase = "advantages"
        shaped = self._advantages(rollout)
        train_metrics = self._train(rollout)
        self.phase = "weight sync"
        started = time.perf_counter()
        synced_bytes = sum(sync() for sync in self.syncs)
        sync_s = time.perf_counter() - started
        self.ledger.record("phase_end", "iteration")
        generate_s = sampling.pop("time/generate_s")
        metrics = {
            "reward/mean": rollout.scores.mean().item(),
            "reward/std": rollout.scores.std().item() if len(rollout.scores) > 1 else 0.0,
            **shaped,
            **train_metrics,
            **sampling,
            **merged_reward_metrics(self.reward_metrics),
            "response/length_mean": rollout.response_lengths.float().mean().item(),
        }
        self.phase = "metrics"
        metrics = self._dp_mean(metrics)
        if isinstance(self.kl_controller, ppo.AdaptiveKLController):
            self.kl_controller.update(metrics["kl/sequence_mean"], self.config.rollout_samples)  # responses, as verl counts them
        end = time.perf_counter()
        metrics["time/generate_s"] = generate_s
        metrics["time/weight_sync_s"], metrics["weight_sync/bytes"] = sync_s, float(synced_bytes)
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
        """Continue from ``state`` (after checkpoint.ppo_state.load_ppo_checkpoint restored the
        trained roles): the serving roles that copy or reshard their weights are served the
        restored ones (those sharing storage already run on them)."""
        for sync in self.syncs:
            sync()
        self.iteration = self.ledger.iteration = state["iteration"]
        self.kl_controller.value = state["kl_coef"]
        self.score_moments.load_state_dict(state["score_moments"])
        self.dataset.load_state_dict(state["dataset"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])

    def _rollout(self):
        """Generate and score (with dynamic sampling: until enough groups carry a signal), then the
        reference log-probs and values of the rows kept. Returns the rollout, (prompt, response)
        pairs and the sampling metrics."""
        cfg, alg = self.config, self.config.algorithm
        rounds = 1 + (alg.dynamic_sampling_extra_rounds if alg.dynamic_sampling else 0)
        generate_s, kept, dropped = 0.0, [], []
        for round_ in range(rounds):
            rows, seconds = self._sample(round_)
            generate_s += seconds
            if not alg.dynamic_sampling:
                break
            # Decided on the rows of every DP rank, so that every rank keeps the same groups and
            # each gets an equal share of them.
            rows = self.cut.gather(rows, self.sampling.pad_id)
            signal = ppo.informative_groups(rows["scores"], cfg.generation.samples_per_prompt)
            kept.append(self._select_groups(rows, signal))
            dropped.append(self._select_groups(rows, ~signal))
            if sum(len(k["scores"]) for k in kept) >= cfg.rollout_samples:
                break
        sampling = {"time/generate_s": generate_s}
        if alg.dynamic_sampling:
            rows, short = self._fill_from(kept, dropped)
            sampling.update({
                "sampling/rounds": float(round_ + 1),
                "sampling/dropped_groups": float(sum(len(d["scores"]) for d in dropped) // cfg.generation.samples_per_prompt),
                "sampling/short_groups": float(short),
            })
        tokens, lengths = rows["tokens"], rows["prompt_lengths"] + rows["response_lengths"]
        ref_log_probs = self._per_token("reference", tokens, lengths)
        old_values = self._per_token("value", tokens, lengths) if "value" in self.roles else None
        n = cfg.generation.samples_per_prompt
        rollout = Rollout(
            tokens, rows["prompt_lengths"], rows["response_lengths"],
            action_mask(tokens.shape[1], rows["prompt_lengths"], rows["response_lengths"]),
            rows["old_log_probs"], ref_log_probs, rows["scores"],
            group_index=torch.arange(len(tokens), device=tokens.device) // n, old_values=old_values,
            routes=rows.get(ROUTES),
        )
        texts = list(zip([self.dataset.prompt_of(i) for i in rows["prompt_index"].tolist()], self._decode(rows)))
        return rollout, texts, sampling

    def _sample(self, round_: int):
        """One rollout batch's worth of prompts, samples_per_prompt responses each: generated, with
        the rollout policy's log-probs, scored. Returns this DP rank's rows and the generation time."""
        cfg = self.config
        n = cfg.generation.samples_per_prompt
        batch = self.dataset.next_batch(cfg.ppo.rollout_batch_size, self.cut.rank, self.cut.size)
        # Every response draws from its own stream, keyed by what it is (run, iteration, round,
        # prompt, sample): the rollout does not depend on the DP layout or the decode batch.
        indices = torch.tensor(batch["indices"]).repeat_interleave(n)
        seeds = stream_seeds(cfg.seed, self.iteration, round_, indices, torch.arange(n).repeat(len(batch["indices"])))
        prompts = {"tokens": batch["tokens"].repeat_interleave(n, 0).to(self.device),
                   "prompt_lengths": batch["lengths"].repeat_interleave(n).to(self.device), "seeds": seeds.to(self.device)}
        timed = []
        rows = self._at_layout("policy", lambda mine: self._rollout_rows(mine, timed), prompts)
        rows["prompt_index"] = torch.tensor(batch["indices"], device=self.device).repeat_interleave(n)
        texts = [text for text in batch["texts"] for _ in range(n)]
        fields = [row for row in batch["fields"] for _ in range(n)]
        rows["scores"] = self._score(texts, self._decode(rows), fields, rows)
        return rows, timed[0]

    def _rollout_rows(self, prompts: SampleRows, timed: List[float]) -> SampleRows:
        """The policy's responses to ``prompts`` (its share of them) and their log-probs under it
        ("old"), with routing replay the record; the generation's seconds appended to ``timed``."""
        cfg, replay = self.config, self.config.moe.routing_replay
        with self._resident("policy", "inference"):
            started = time.perf_counter()
            gen = self._generate(prompts, self.sampling, record_routes=replay == "rollout")
            timed.append(time.perf_counter() - started)
            # Routing replay: the record is generation's, or taken by this pass (models/routing.py).
            recorded = [] if replay == "old_logprob" else None
            old_log_probs = inference.log_probs(self.roles["policy"], gen.tokens, gen.total_lengths, self.vocab_size,
                                                cfg.generation.temperature, routes=gen.routes, routes_out=recorded)
        rows = {"tokens": gen.tokens, "prompt_lengths": gen.prompt_lengths, "response_lengths": gen.response_lengths,
                "old_log_probs": old_log_probs}
        routes = recorded[0] if recorded else gen.routes
        if routes is not None:
            rows[ROUTES] = routes
        return rows

    def _generate(self, prompts: SampleRows, sampling: SamplingParams, record_routes: bool = False):
        """Responses of the (resident) policy to ``prompts`` (tokens [B, P], prompt_lengths [B],
        seeds [B]), its KV cache in the ledger."""
        policy = self.roles["policy"]
        return generate(
            policy.model, prompts["tokens"], prompts["prompt_lengths"], sampling, self.vocab_size, prompts["seeds"],
            batch_size=self.config.generation.batch_size,
            cache_length=self.config.data.max_prompt_length + self.config.generation.max_new_tokens,
            on_cache=lambda cache: policy.memory.holding(KV_CACHE, [cache.storage], "generate"),
            record_routes=record_routes,
        )

    def _per_token(self, name: str, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, S-1] per action of role ``name`` (reference: log-probs, value: values) over this rank's rows."""
        role, temperature = self.roles[name], self.config.generation.temperature

        def run(mine: SampleRows) -> SampleRows:
            with self._resident(name, "inference"):
                if role.head == "lm":
                    out = inference.log_probs(role, mine["tokens"], mine["lengths"], self.vocab_size, temperature)
                else:
                    out = inference.values(role, mine["tokens"], mine["lengths"])
            return {"per_action": out}

        return self._at_layout(name, run, {"tokens": tokens, "lengths": lengths}, tokens.shape[1])["per_action"]

    def _at_layout(self, name: str, run, rows: SampleRows, width: Optional[int] = None) -> SampleRows:
        """``run(rows)`` on role ``name``'s share of ``rows`` (this rank's share in the run's cut):
        the same rows when the role runs at the run's layout; otherwise its own DP share, and the
        result's columns come back in the run's cut, ``width`` positions wide (default: the longest
        row's). Collective over both DP groups."""
        cut = self.cuts[name]
        if cut == self.cut:
            return run(rows)
        pad = self.sampling.pad_id
        out = recut(run(recut(rows, self.cut, cut, pad)), cut, self.cut, pad)
        return trimmed(out, width)

    # -- validation ---------------------------------------------------------------------------

    def validate(self) -> Dict[str, float]:
        """Responses to every validation prompt (trainer.val_samples_per_prompt each, greedy or
        sampled as in training, each from its own stream), scored like the rollout's: val/reward/mean,
        val/mean@k (the mean score), val/pass@k (the share of prompts with a response that scores at
        least 1, a verifier's "correct"), overall and per data_source. The same on every rank."""
        cfg, data = self.config, self.val_dataset
        k = cfg.trainer.val_samples_per_prompt
        sampling = dataclasses.replace(self.sampling, greedy=cfg.trainer.val_greedy)
        cut = self.cuts["policy"]  # generated in the policy's cut, scored in the run's
        mine = data.usable_indices()[cut.rank :: cut.size]
        chunk = max(1, cfg.ppo.rollout_batch_size // cut.size)
        generated = []
        with self._resident("policy", "inference"):
            for start in range(0, len(mine), chunk):
                indices = mine[start : start + chunk]
                batch = data.batch_of(indices)
                seeds = stream_seeds(cfg.seed, VALIDATION_STREAM, 0, torch.tensor(indices).repeat_interleave(k),
                                     torch.arange(k).repeat(len(indices)))
                prompts = {"tokens": batch["tokens"].repeat_interleave(k, 0).to(self.device),
                           "prompt_lengths": batch["lengths"].repeat_interleave(k), "seeds": seeds}
                gen = self._generate(prompts, sampling)
                generated.append((batch, {"tokens": gen.tokens, "prompt_lengths": gen.prompt_lengths,
                                          "response_lengths": gen.response_lengths}))
        if cut != self.cut:
            generated = self._chunks_in_run_cut(generated, cut)
        results = []  # (data source, scores of the prompt's k responses)
        self.reward_metrics = []
        for batch, rows in generated:  # scored once the policy has left (a reward model may need the room)
            prompts = [t for t in batch["texts"] for _ in range(k)]
            fields = [f for f in batch["fields"] for _ in range(k)]
            scores = self._score(prompts, self._decode(rows), fields, rows).view(len(batch["texts"]), k).cpu()
            results += [(str(f.get("data_source") or ""), s.tolist()) for f, s in zip(batch["fields"], scores)]
        gathered = [None] * self.cut.size
        dist.all_gather_object(gathered, results, group=self.cut.group)
        return validation_metrics([r for part in gathered for r in part], k)

    def _chunks_in_run_cut(self, generated: List, cut: RowCut) -> List:
        """Validation's (batch, rows) chunks generated in ``cut`` -> this rank's chunks in the run's
        cut (every chunk of every rank of ``cut`` gathered, every run DP rank taking its turn)."""
        local = [(batch, {k: v.cpu() for k, v in rows.items()}) for batch, rows in generated]
        gathered = [None] * cut.size
        dist.all_gather_object(gathered, local, group=cut.group)
        chunks = [c for part in gathered for c in part][self.cut.rank :: self.cut.size]
        return [(batch, {k: v.to(self.device) for k, v in rows.items()}) for batch, rows in chunks]

    def _score(self, prompts: List[str], responses: List[str], fields: List[Dict], rows: SampleRows) -> torch.Tensor:
        """[B] scores of the reward (rule functions or model) of the sample ``rows``, plus the
        overlong penalty when set. The rule functions' metrics (failures, sub-scores) add up in
        ``reward_metrics``."""
        if self.config.reward.type == "function":
            scores, metrics = self._rule_scores(prompts, responses, fields)
            scores = scores.to(self.device)
            self.reward_metrics.append(metrics)
        else:
            scores = self._reward_model_scores(rows)
        check_scores(scores, self.config.reward.max_abs_score, self.iteration, prompts)
        alg = self.config.algorithm
        if alg.overlong_buffer_length:
            scores = scores + ppo.overlong_penalty(rows["response_lengths"], self.config.generation.max_new_tokens,
                                                   alg.overlong_buffer_length, alg.overlong_penalty_factor).to(scores.device)
        return scores

    def _reward_model_scores(self, rows: SampleRows) -> torch.Tensor:
        """[B] the reward model's score at each row's last response token."""

        def run(mine: SampleRows) -> SampleRows:
            last = (mine["prompt_lengths"] + mine["response_lengths"] - 1).clamp(min=0)
            with self._resident("reward", "inference"):
                return {"scores": inference.scores(self.roles["reward"], mine["tokens"], last)}

        columns = {k: rows[k] for k in ("tokens", "prompt_lengths", "response_lengths")}
        return self._at_layout("reward", run, columns, rows["tokens"].shape[1])["scores"]

    def _rule_scores(self, prompts: List[str], responses: List[str], fields: List[Dict]):
        """The rule reward's (scores, metrics), computed on the first rank of the model-parallel
        group and sent to the others: every rank of a replica holds the same rows, and a time-out
        on one of them must not give its TP or PP peers other scores."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        result = [None]
        if group.rank() == 0:
            try:
                result = [self.reward_scorer.score(prompts, responses, fields)]
            except RewardFunctionError as e:  # the peers learn it too, so none waits for scores
                result = [e]
        if group.size() > 1:
            dist.broadcast_object_list(result, src=dist.get_global_rank(group, 0), group=group)
        if isinstance(result[0], RewardFunctionError):
            raise RewardFunctionError(str(result[0]))
        return result[0]

    def _decode(self, rows: SampleRows) -> List[str]:
        return [
            self.tokenizer.decode(row[p : p + r].tolist())
            for row, p, r in zip(rows["tokens"].cpu(), rows["prompt_lengths"].tolist(), rows["response_lengths"].tolist())
        ]

    def _select_groups(self, rows: SampleRows, groups: torch.Tensor) -> SampleRows:
        """The rows of the groups where ``groups`` [G] is True."""
        picked = groups.repeat_interleave(self.config.generation.samples_per_prompt)
        return {k: v[picked] for k, v in rows.items()}

    def _fill_from(self, kept: List[SampleRows], dropped: List[SampleRows]):
        """This rank's share of the first rollout's worth of kept groups (all ranks' rows, in the
        order they were drawn). When the rounds ran out first, the gap is filled with dropped groups
        (their advantages carry no group signal) so that every step keeps its size; returns the
        rows and how many groups filled it that way."""
        need = self.config.rollout_samples
        short = max(0, need - sum(len(k["scores"]) for k in kept))
        rows = cat_rows(kept + dropped, self.sampling.pad_id)  # kept groups first
        mine = trimmed(self.cut.share({k: v[:need] for k, v in rows.items()}))  # to its own longest row
        return mine, short // self.config.generation.samples_per_prompt

    def _advantages(self, r: Rollout) -> Dict[str, float]:
        """Fill r.advantages (and, for GAE, r.returns) by the configured estimator; returns the KL
        metrics. Whitening and reward moments use the whole rollout (every DP rank's rows)."""
        p, alg = self.config.ppo, self.config.algorithm
        mask = r.action_mask
        kl = ppo.kl_penalty(r.old_log_probs, r.ref_log_probs, p.kl_estimator) * mask
        scores = ppo.clip_rewards(r.scores, p.reward_clip)
        if p.normalize_reward:
            # Every score of the rollout, in DP-rank order: the moments are the same on every rank.
            self.score_moments.update(self.cut.gather_tensor(scores))
            scores = scores / (self.score_moments.std + 1e-8)
        rewards = ppo.token_rewards(scores, kl, 0.0 if p.kl_in_loss else self.kl_controller.value, mask)
        estimator = ppo.ESTIMATORS[alg.advantage_estimator]
        advantages, r.returns = estimator.advantages(ppo.EstimatorInputs(
            rewards, mask, r.old_values, r.group_index, p.gamma, p.lam, alg.norm_adv_by_std_in_grpo))
        out = {}
        if r.returns is not None:
            out = {"returns/mean": ppo.masked_mean(r.returns, mask).item(),
                   "values/mean": ppo.masked_mean(r.old_values, mask).item()}
        if estimator.whitened(p.whiten_advantages):  # by the statistics of the whole rollout, not this rank's share
            moments = sum_over(ppo.masked_moments(advantages, mask), self.cut.group)
            advantages = ppo.whiten_with_moments(advantages, mask, moments)
        r.advantages = advantages
        return {
            "kl/mean": ppo.masked_mean(kl, mask).item(),
            "kl/sequence_mean": kl.sum(dim=1).mean().item(),
            "kl/coef": self.kl_controller.value,
            "advantages/abs_mean": ppo.masked_mean(advantages.abs(), mask).item(),
            **out,
        }

    def _train(self, r: Rollout) -> Dict[str, float]:
        cfg = self.config
        policy_columns = dict(tokens=r.tokens, action_mask=r.action_mask, old_log_probs=r.old_log_probs, advantages=r.advantages)
        if cfg.ppo.kl_in_loss:
            policy_columns["ref_log_probs"] = r.ref_log_probs
        if r.routes is not None:
            policy_columns[ROUTES] = r.routes
        policy_loss = policy_loss_fn(self.vocab_size, cfg.generation.temperature, cfg.ppo, self.kl_controller.value)
        lengths = r.prompt_lengths + r.response_lengths
        out = {}
        start = time.perf_counter()
        out.update(self._train_role("ppo_policy", policy_columns, lengths, policy_loss, "policy", policy_stats(cfg.ppo)))
        if "ppo_value" in self.roles:
            value_columns = dict(tokens=r.tokens, action_mask=r.action_mask, old_values=r.old_values, returns=r.returns)
            value_loss = value_loss_fn(cfg.ppo.value_clip, cfg.ppo.loss_agg_mode)
            out.update(self._train_role("ppo_value", value_columns, lengths, value_loss, "value", ("clipfrac",)))
        out["time/train_s"] = time.perf_counter() - start
        return out

    def _train_role(self, name: str, columns: Dict[str, torch.Tensor], lengths: torch.Tensor, loss_fn, prefix: str,
                    stats) -> Dict[str, float]:
        """ppo_epochs passes over the rollout in optimizer steps of samples_per_step rows; each step's
        rows (``lengths`` [B]: real tokens each) are grouped by length into micro-batches trimmed to
        their own longest row."""
        cfg = self.config
        role = self.roles[name]
        rows = columns["tokens"].shape[0]
        step_rows = cfg.samples_per_step(name) // self.cut.size
        steps: List[List[Dict[str, torch.Tensor]]] = []  # per optimizer step, its micro-batches' metric sums
        grad_norms, skipped, router_losses = [], 0, []
        with self._resident(name, "training"):
            for epoch in range(cfg.ppo.ppo_epochs):
                # The same order on every rank of this replica (its TP and PP ranks must agree).
                order = torch.randperm(rows, generator=torch.Generator().manual_seed(
                    cfg.seed + 7_919 * self.iteration + 104_729 * epoch)).to(columns["tokens"].device)
                for first in range(0, rows, step_rows):
                    picked = order[first : first + step_rows]
                    mbs, _ = length_grouped(role.config.micro_batch_size, lengths[picked], **{k: v[picked] for k, v in columns.items()})
                    result = role.train_step(mbs, loss_fn)
                    if result["non_finite"] is not None:
                        if cfg.trainer.on_non_finite == "stop":
                            raise NonFiniteError(
                                f"iteration {self.iteration}: {name}: non-finite {result['non_finite']} in optimizer "
                                f"step {len(steps) + skipped + 1} (epoch {epoch + 1}); the step was not applied and "
                                f"nothing of this iteration was saved. Look for extreme rewards or a learning rate "
                                f"too high ({name}.lr={role.config.lr}); trainer.on_non_finite: skip skips such steps", collective=True)
                        skipped += 1
                        continue
                    steps.append(result["metrics"])
                    grad_norms.append(float(result["grad_norm"]))
                    router_losses.append(result["moe"])
        metrics = reported_metrics(steps, prefix, stats, self.device, self.cut.group, groups_of(role.model).pp) \
            if steps else {f"loss/{prefix}": float("nan")}
        grad_norm = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        # Each step's router losses are already the same on every rank: the mean over the steps.
        router = {f"{prefix}/{k}": sum(r[k] for r in router_losses) / len(router_losses) for k in router_losses[0]} \
            if router_losses else {}
        return {**metrics, **router, f"{prefix}/grad_norm": grad_norm, f"{prefix}/skipped_steps": float(skipped)}

    def _dp_mean(self, metrics: Dict[str, float]) -> Dict[str, float]:
        """The mean over DP ranks (equal shares of the rollout), the sum for counts. A metric only
        some ranks have (a reward's sub-score where every call of it failed) is the mean of those."""
        if self.cut.size == 1:
            return metrics
        names = [None] * self.cut.size
        dist.all_gather_object(names, sorted(metrics), group=self.cut.group)
        keys = sorted(set().union(*names))
        local = torch.tensor([[metrics.get(k, 0.0), float(k in metrics)] for k in keys], dtype=torch.float64,
                             device=self.device)
        totals = sum_over(local, self.cut.group).tolist()
        return {k: v if k in COUNTED_METRICS else v / present for k, (v, present) in zip(keys, totals)}


COUNTED_METRICS = ("reward/failures", "reward/timeouts")
VALIDATION_STREAM = -1  # the iteration key of validation's sampling streams (training's are >= 1)


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


def merged_reward_metrics(parts: List[Dict[str, float]]) -> Dict[str, float]:
    """The rule reward's metrics of an iteration's scoring rounds: counts added, means averaged."""
    merged: Dict[str, float] = {}
    for key in sorted({k for part in parts for k in part}):
        values = [part[key] for part in parts if key in part]
        merged[key] = sum(values) if key in COUNTED_METRICS else sum(values) / len(values)
    return merged
