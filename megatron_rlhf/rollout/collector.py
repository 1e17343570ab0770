"""Collecting an iteration's rollout: the policy answers ``samples_per_prompt`` times per prompt (one
turn, or a trajectory of turns with an environment: rollout/multiturn.py) and scores its own
tokens ("old" log-probs), the reward scores each response (with dynamic sampling: groups without
a signal dropped over every DP rank and more generated), then the reference's log-probs and the
value model's values of the rows kept. Every phase returns its rows and metrics.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rlhf import ppo
from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.data import PromptDataset, Tokenizer
from megatron_rlhf.data.prompts import prompt_text
from megatron_rlhf.generation import CacheSession, OpenRun, SamplingParams, generate
from megatron_rlhf.memory import KV_CACHE
from megatron_rlhf.models.batches import action_mask
from megatron_rlhf.models.routing import ROUTES
from megatron_rlhf.roles import inference
from megatron_rlhf.roles.role_set import RoleSet
from megatron_rlhf.rollout.partial import PartialRollouts
from megatron_rlhf.rollout.partial_turns import PartialTrajectories
from megatron_rlhf.rollout.record import BEHAVIOUR, Collected, Prompts, Rollout, is_counted, merged_metrics
from megatron_rlhf.roles.rows import SampleRows, cat_rows, trimmed
from megatron_rlhf.rollout.scoring import STEP_REWARDS, Scorer
from megatron_rlhf.runtime.platform import get_platform
from megatron_rlhf.runtime.host_groups import host_group, host_sum


SAMPLES_SHOWN = 4  # rows of each iteration the run shows (the printed sample line, samples.jsonl)


class RolloutCollector:
    """``turns``: the multi-turn runner (an environment answers between the policy's turns), or
    None for one response per sample."""

    def __init__(self, config: RLHFConfig, roles: RoleSet, tokenizer: Tokenizer, scorer: Scorer, turns=None):
        self.config = config
        self.roles = roles
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.turns = turns
        self.vocab_size = tokenizer.vocab_size
        self.device = get_platform().device
        self.sampling = SamplingParams.from_config(config.generation, tokenizer.eos_ids, tokenizer.pad_id)
        # The engine's log-probs of its tokens, for rollout correction (partial rollouts record them anyway).
        self.records_behaviour = config.algorithm.rollout_correction.mode != "off"
        self.partial = None
        if config.rollout.partial.enabled:
            self.partial = (PartialRollouts if turns is None else PartialTrajectories)(config, self)

    # -- an iteration's rollout ------------------------------------------------------------------

    def collect(self, dataset: PromptDataset, iteration: int) -> Collected:
        """Generate and score (with dynamic sampling: until enough groups carry a signal), then
        the reference log-probs and values of the rows kept."""
        cfg, alg = self.config, self.config.algorithm
        n = cfg.generation.samples_per_prompt
        rounds = 1 + (alg.dynamic_sampling_extra_rounds if alg.dynamic_sampling else 0)
        parts, kept, dropped = [], [], []  # the rounds' metrics (generation, scoring)
        for round_ in range(rounds):
            if self.partial is not None:
                rows, generated = self.partial.rows(dataset, iteration, round_)
                if "action_mask" not in rows:  # a trajectory's comes with it (its environment's tokens masked)
                    rows["action_mask"] = action_mask(rows["tokens"].shape[1], rows["prompt_lengths"], rows["response_lengths"])
                texts, fields = _prompt_columns(dataset, rows["prompt_index"])
            else:
                batch = dataset.next_batch(cfg.ppo.rollout_batch_size, self.roles.cut.rank, self.roles.cut.size)
                prompts = Prompts.expand(batch, n, cfg.seed, iteration, round_, self.device)
                rows, generated = self.policy_rows(prompts, self.sampling, training=True)
                texts, fields = prompts.texts, prompts.fields
            rows["scores"], rewarded = self.scorer.score(texts, self.decode(rows), fields, rows, iteration)
            parts += [generated, rewarded]
            if not alg.dynamic_sampling:
                break
            # Decided on the rows of every DP rank, so that every rank keeps the same groups and
            # each gets an equal share of them.
            rows = self.roles.cut.gather(rows, self.sampling.pad_id)
            signal = ppo.informative_groups(rows["scores"], n)
            kept.append(_select_groups(rows, signal, n))
            dropped.append(_select_groups(rows, ~signal, n))
            if sum(len(k["scores"]) for k in kept) >= cfg.rollout_samples:
                break
        metrics = {}
        if alg.dynamic_sampling:
            rows, short = self._fill_from(kept, dropped)
            metrics.update({
                "sampling/rounds": float(round_ + 1),
                "sampling/dropped_groups": float(sum(len(d["scores"]) for d in dropped) // n),
                "sampling/short_groups": float(short),
            })
        metrics.update(merged_metrics(parts))
        rollout = self._experience(rows)
        return Collected(rollout, self._samples(dataset, rows), metrics)

    def _samples(self, dataset: PromptDataset, rows: SampleRows) -> List[Dict]:
        """The first SAMPLES_SHOWN rows of this rank as the run shows them: prompt, response, score
        and (when the data has one) ground truth."""
        shown = {k: v[:SAMPLES_SHOWN] for k, v in rows.items()}
        out = []
        texts, fields = _prompt_columns(dataset, shown["prompt_index"])
        for text, row_fields, response, score in zip(texts, fields, self.decode(shown), shown["scores"].tolist()):
            sample = {"prompt": text, "response": response, "score": score}
            if "ground_truth" in row_fields:
                sample["ground_truth"] = row_fields["ground_truth"]
            out.append(sample)
        return out

    def _experience(self, rows: SampleRows) -> Rollout:
        """The rollout of the kept ``rows``: the reference's log-probs and the value model's values added."""
        tokens, lengths = rows["tokens"], rows["prompt_lengths"] + rows["response_lengths"]
        ref_log_probs = self._per_token("reference", tokens, lengths)
        old_values = self._per_token("value", tokens, lengths) if "value" in self.roles else None
        return Rollout(
            tokens, rows["prompt_lengths"], rows["response_lengths"], rows["action_mask"], rows["old_log_probs"],
            ref_log_probs, rows["scores"], group_index=torch.arange(len(tokens), device=tokens.device) // self.config.generation.samples_per_prompt,
            old_values=old_values, routes=rows.get(ROUTES), behaviour_log_probs=rows.get(BEHAVIOUR),
            step_rewards=rows.get(STEP_REWARDS),
        )

    # -- the policy's responses ----------------------------------------------------------------

    def policy_rows(self, prompts: Prompts, sampling: SamplingParams, training: bool) -> Tuple[SampleRows, Dict[str, float]]:
        """The policy's responses to ``prompts`` (this rank's rows in the run's cut), generated in
        the policy's cut, with its log-probs of them ("old") when ``training``, and (routing replay)
        the record. Returns the rows (``prompt_index`` and the loss mask ``action_mask`` included)
        and the metrics of generating them (``time/generate_s``, a trajectory's turns)."""
        replay = self.config.moe.routing_replay if training else "off"
        out: Dict[str, float] = {}
        prompt_of = self._prompts_of_the_rollout(prompts) if self.turns is not None else None

        def run(mine: SampleRows) -> SampleRows:
            with self.roles.resident("policy", "inference"):
                started = time.perf_counter()
                rows, turn_metrics = self.generate(mine, prompts, sampling, record_routes=replay == "rollout",
                                                   record_log_probs=training and self.records_behaviour,
                                                   prompt_of=prompt_of)
                out["time/generate_s"] = time.perf_counter() - started
                out.update(turn_metrics)
                if training:
                    self.add_old_log_probs(rows, replay)
            return rows

        rows = self.roles.at_layout("policy", run, prompts.columns())
        if self.turns is not None and self.roles.cuts["policy"] != self.roles.cut:
            out = self.as_run_share(out)
        if "action_mask" not in rows:
            rows["action_mask"] = action_mask(rows["tokens"].shape[1], rows["prompt_lengths"], rows["response_lengths"])
        return rows, out

    def as_run_share(self, metrics: Dict[str, float]) -> Dict[str, float]:
        """Turn metrics measured on the policy's own DP share, as this rank's share of the run's:
        counts summed over the policy's DP ranks and spread evenly over the run's (the run adds
        them up again), the others averaged over the policy's (equal shares)."""
        own = self.roles.cuts["policy"]
        names = [None] * own.size  # an environment's own counts may be on some ranks only
        dist.all_gather_object(names, sorted(metrics), group=host_group(own.group))
        keys = sorted({k for part in names for k in part})
        values = host_sum([metrics.get(k, 0.0) for k in keys], own.group)
        return {k: v / (self.roles.cut.size if is_counted(k) else own.size) for k, v in zip(keys, values.tolist())}

    def _prompts_of_the_rollout(self, prompts: Prompts) -> Dict[int, Tuple[str, Dict]]:
        """Every row's prompt and data columns by dataset row, this rank's and, with the policy at a
        layout of its own, the other DP ranks' too (its cut of the rows is not the run's)."""
        mine = _prompt_map(prompts)
        if not self.config.has_own_layout("policy") or self.roles.cut.size == 1:
            return mine
        everyone = [None] * self.roles.cut.size
        dist.all_gather_object(everyone, mine, group=host_group(self.roles.cut.group))
        return {i: value for part in everyone for i, value in part.items()}

    def generate(self, mine: SampleRows, prompts: Prompts, sampling: SamplingParams, record_routes: bool = False,
                 record_log_probs: bool = False, prompt_of: Optional[Dict[int, Tuple[str, Dict]]] = None
                 ) -> Tuple[SampleRows, Dict[str, float]]:
        """The (resident) policy's responses to the prompt rows ``mine`` (tokens, prompt_lengths,
        seeds, prompt_index: this rank's share in the policy's cut): one turn each, or with an
        environment a trajectory of turns. Returns the sample rows (with ``record_log_probs`` the
        engine's log-probs of its tokens, BEHAVIOUR) and the turns' metrics."""
        if self.turns is not None:  # each row's prompt by its dataset row: the policy's cut may be its own
            prompt_of = prompt_of or _prompt_map(prompts)
            columns = [prompt_of[i] for i in mine["prompt_index"].tolist()]
            return self.turns.run(self, mine, [c[0] for c in columns], [c[1] for c in columns], sampling, record_log_probs)
        gen = self.engine(mine, sampling, record_routes=record_routes, record_log_probs=record_log_probs)
        rows = {"tokens": gen.tokens, "prompt_lengths": gen.prompt_lengths, "response_lengths": gen.response_lengths,
                "prompt_index": mine["prompt_index"]}
        if gen.routes is not None:
            rows[ROUTES] = gen.routes
        if gen.log_probs is not None:
            rows[BEHAVIOUR] = gen.log_probs
        return rows, {}

    def engine(self, mine: SampleRows, sampling: SamplingParams, record_routes: bool = False, **options):
        """One generate() of the (resident) policy over ``mine``, its KV cache in the ledger.
        ``options``: generate()'s per-call ones (a cache session and its keys, per-row limits)."""
        policy = self.roles["policy"]
        return generate(
            policy.model, mine["tokens"], mine["prompt_lengths"], sampling, self.vocab_size, mine["seeds"],
            batch_size=self.config.generation.batch_size, cache_length=self.config.sequence_tokens,
            on_cache=self._ledger_record, record_routes=record_routes, **options,
        )

    def cache_session(self, rows: int) -> CacheSession:
        """A KV cache kept across the turns of ``rows`` trajectories (as many slots as
        generation.batch_size allows), in the ledger while it lives."""
        return CacheSession(self.config.generation.slots(rows), self.config.sequence_tokens,
                            self._ledger_record)

    @contextlib.contextmanager
    def open_run(self, rows: int, sampling: SamplingParams, record_log_probs: bool = False):
        """An engine run of the (resident) policy that ``rows`` trajectories' turns join as they
        come (generation/open_run.py), its KV cache kept across their turns and in the ledger."""
        with self.cache_session(rows) as session, OpenRun(self.roles["policy"].model, sampling, self.vocab_size,
                                                          session, record_log_probs=record_log_probs) as run:
            yield run

    def _ledger_record(self, cache):
        return self.roles["policy"].memory.holding(KV_CACHE, [cache.storage], "generate")

    def add_old_log_probs(self, rows: SampleRows, replay: str) -> None:
        """The policy's log-probs of ``rows`` ("old"); routing replay's record kept (generation's),
        or taken by this pass (models/routing.py)."""
        recorded = [] if replay == "old_logprob" else None
        rows["old_log_probs"] = inference.log_probs(
            self.roles["policy"], rows["tokens"], rows["prompt_lengths"] + rows["response_lengths"], self.vocab_size,
            self.config.generation.temperature, routes=rows.get(ROUTES), routes_out=recorded)
        if recorded:
            rows[ROUTES] = recorded[0]

    # -- the other roles' passes ---------------------------------------------------------------

    def _per_token(self, name: str, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, S-1] per action of role ``name`` (reference: log-probs, value: values) over this rank's rows."""
        role, temperature = self.roles[name], self.config.generation.temperature

        def run(mine: SampleRows) -> SampleRows:
            with self.roles.resident(name, "inference"):
                if role.head == "lm":
                    out = inference.log_probs(role, mine["tokens"], mine["lengths"], self.vocab_size, temperature)
                else:
                    out = inference.values(role, mine["tokens"], mine["lengths"])
            return {"per_action": out}

        return self.roles.at_layout(name, run, {"tokens": tokens, "lengths": lengths}, tokens.shape[1])["per_action"]

    def decode(self, rows: SampleRows) -> List[str]:
        """Each row's response text (a trajectory's: the model's turns and the environment's replies)."""
        return [
            self.tokenizer.decode(row[p : p + r].tolist())
            for row, p, r in zip(rows["tokens"].cpu(), rows["prompt_lengths"].tolist(), rows["response_lengths"].tolist())
        ]

    def _fill_from(self, kept: List[SampleRows], dropped: List[SampleRows]):
        """This rank's share of the first rollout's worth of kept groups (all ranks' rows, in the
        order they were drawn). When the rounds ran out first, the gap is filled with dropped groups
        (their advantages carry no group signal) so that every step keeps its size; returns the
        rows and how many groups filled it that way."""
        need = self.config.rollout_samples
        short = max(0, need - sum(len(k["scores"]) for k in kept))
        rows = cat_rows(kept + dropped, self.sampling.pad_id)  # kept groups first
        mine = trimmed(self.roles.cut.share({k: v[:need] for k, v in rows.items()}))  # to its own longest row
        return mine, short // self.config.generation.samples_per_prompt


def _prompt_map(prompts: Prompts) -> Dict[int, Tuple[str, Dict]]:
    """Dataset row -> (the prompt as the reward sees it, the row's other columns) of ``prompts``."""
    return {int(i): (text, row) for i, text, row in zip(prompts.prompt_index.tolist(), prompts.texts, prompts.fields)}


def _prompt_columns(dataset: PromptDataset, prompt_index: torch.Tensor) -> Tuple[List[str], List[Dict]]:
    """Per row: the prompt as the reward sees it and the data row's other columns (as
    PromptDataset.batch_of gives them)."""
    texts, fields = [], []
    for index in prompt_index.tolist():
        prompt, row_fields = dataset.rows.prompt_and_fields(index)
        texts.append(prompt_text(prompt))
        fields.append(row_fields)
    return texts, fields


def _select_groups(rows: SampleRows, groups: torch.Tensor, samples: int) -> SampleRows:
    """The rows of the groups where ``groups`` [G] is True."""
    picked = groups.repeat_interleave(samples)
    return {k: v[picked] for k, v in rows.items()}
