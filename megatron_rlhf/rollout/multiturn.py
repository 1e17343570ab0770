"""Multi-turn rollouts: the policy writes a turn, the environment answers, the policy writes again.

Per policy replica, over its rows: every trajectory starts (the environment's first observation
appended to the prompt), then each turn the engine generates for every trajectory still going, and
the environment steps each one (its calls concurrent in worker processes, on the replica's first
rank, the results sent to its other ranks). A turn ends at an end token, at one of
``rollout.stop``'s tokens, or at ``max_tokens_per_turn``; a trajectory at the environment's
``done``, at ``max_turns``, at ``max_trajectory_tokens`` or when its environment fails (counted,
with the reason). A reply after the last turn is not appended: a trajectory ends with the model's
tokens. Each turn's tokens draw from the response's own stream (keyed by the turn), so the rollout
does not depend on the layout or on which trajectories share a turn's batch.

The engine keeps each trajectory's KV cache across its turns (a cache session for the batch,
generation/session.py): a continuing trajectory feeds only the environment's reply and its own
last token. With fewer decode slots (generation.batch_size) than trajectories, a slot freed by a
trajectory whose turn ended is given to a waiting one, and the first loses its cache: its next
turn prefills its prefix again (``rollout/prefix_recomputed`` counts those prefills).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.errors import RunError
from megatron_rlhf.generation import CacheSession, SamplingParams, stream_seeds
from megatron_rlhf.models.decoder import global_rank, groups_of
from megatron_rlhf.rollout.env_pool import EnvironmentPool
from megatron_rlhf.rollout.record import COUNTED_METRICS
from megatron_rlhf.roles.rows import SampleRows
from megatron_rlhf.rollout.trajectory import ObservationEncoder, Trajectory

TURN_COUNTS = tuple(k for k in COUNTED_METRICS if k.startswith("rollout/"))


class EnvironmentFailure(RunError):
    """Every trajectory of a batch failed in its environment."""


class MultiTurn:
    """``spec``: the environment (resolved against its config file); ``chat``: replies go through
    the tokenizer's chat template."""

    def __init__(self, config: RLHFConfig, tokenizer, spec: str, chat: bool):
        r = config.rollout
        self.config, self.tokenizer, self.spec = config, tokenizer, spec
        self.encoder = ObservationEncoder(tokenizer, chat)
        self.turn_tokens = r.turn_tokens(config.generation)
        self.context = r.trajectory_tokens(config.data, config.generation)
        self.options, stops = {}, list(r.stop)
        if r.uses_tools:  # the built-in tool environment: its options, and its parser's stop strings
            from megatron_rlhf.agents.tool_environment import tool_options, tool_set_of

            self.options = tool_options(config)
            stops += tool_set_of(self.options, keep_servers=False)[1].stop
        # A stop string of one token ends the turn in the engine; a longer one cuts the turn after it.
        self.stop_ids = tuple(ids[0] for ids in map(tokenizer.encode_text, stops) if len(ids) == 1)
        self.stop_strings = tuple(s for s in stops if len(tokenizer.encode_text(s)) != 1)
        self.pool: Optional[EnvironmentPool] = None  # started on the first call, on the replica's first rank
        self.next_id = 0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    # -- one batch of trajectories ---------------------------------------------------------------

    def run(self, collector, mine: SampleRows, texts: List[str], fields: List[Dict], sampling: SamplingParams
            ) -> Tuple[SampleRows, Dict[str, float]]:
        """Trajectories for the prompt rows ``mine`` (the policy resident; ``texts`` and ``fields``:
        each row's prompt and data columns); the sample rows (with the loss mask ``action_mask`` and
        the per-turn rewards ``turn_rewards``) and the metrics."""
        groups = groups_of(collector.roles["policy"].model)
        counts = dict.fromkeys(TURN_COUNTS, 0.0)
        env_s = 0.0
        lengths = mine["prompt_lengths"].tolist()
        trajectories = [Trajectory(row[:n].tolist(), self._new_id()) for row, n in zip(mine["tokens"].cpu(), lengths)]
        rows = [{"prompt": text, **row} for text, row in zip(texts, fields)]
        started = time.perf_counter()
        self._environment_calls(trajectories, [("start", row) for row in rows], groups, counts, last_turn=False)
        env_s += time.perf_counter() - started
        turn_params = dataclasses.replace(sampling, max_new_tokens=self.turn_tokens,
                                          eos_ids=tuple(dict.fromkeys(sampling.eos_ids + self.stop_ids)))
        with collector.cache_session(len(trajectories)) as session:
            for turn in range(self.config.rollout.max_turns):
                live = [i for i, t in enumerate(trajectories) if not t.done]
                if not live:
                    break
                turns = self._generate(collector, session, trajectories, live, mine["seeds"], turn, turn_params, counts)
                started = time.perf_counter()
                last = turn == self.config.rollout.max_turns - 1
                self._environment_calls([trajectories[i] for i in live], [("step", t) for t in turns], groups, counts, last)
                env_s += time.perf_counter() - started
        self._release(trajectories, groups)
        if _every_one_failed(trajectories, mine["seeds"].device):
            first = next((t.failure for t in trajectories if t.failure), "failure was on another rank")
            raise EnvironmentFailure(f"environment {self.spec}: every trajectory of the batch failed; the first "
                                     f"{first}", collective=True)
        out = _rows(trajectories, mine["prompt_index"], self.tokenizer.pad_id)
        return out, self._metrics(trajectories, counts, env_s)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _generate(self, collector, session: CacheSession, trajectories: List[Trajectory], live: List[int],
                  seeds: torch.Tensor, turn: int, params: SamplingParams, counts: Dict[str, float]) -> List[dict]:
        """One turn of the model for the ``live`` trajectories (each up to the turn's limit or the
        context's end); appends its tokens; returns each turn as the environment sees it."""
        device = seeds.device
        prefixes = [trajectories[i].tokens for i in live]
        width = max(len(p) for p in prefixes)
        tokens = torch.full((len(live), width), self.tokenizer.pad_id, dtype=torch.long)
        for row, prefix in enumerate(prefixes):
            tokens[row, : len(prefix)] = torch.tensor(prefix)
        live_seeds = seeds[torch.tensor(live, device=device)]
        # Turn 0 draws as a single response would; every later turn from its own stream.
        turn_seeds = live_seeds if turn == 0 else stream_seeds(live_seeds, turn).to(device)
        sub = {"tokens": tokens.to(device), "prompt_lengths": torch.tensor([len(p) for p in prefixes], device=device),
               "seeds": turn_seeds}
        limits = [min(self.turn_tokens, self.context - len(p)) for p in prefixes]
        gen = collector.engine(sub, params, max_new_tokens=limits, session=session,
                               keys=[trajectories[i].index for i in live])
        counts["rollout/prefix_recomputed"] += sum(trajectories[i].turns > 0 for i in live) - gen.stats.resumed
        out = []
        for row, i in enumerate(live):
            t = trajectories[i]
            p, r = len(prefixes[row]), int(gen.response_lengths[row])
            ids = self._cut_at_stop(gen.tokens[row, p : p + r].tolist())
            if len(t.tokens) + len(ids) >= self.context:  # the context is full: the trajectory ends
                t.done = True
                counts["rollout/context_truncated"] += 1
            t.append_model(ids)
            out.append({"text": self.tokenizer.decode(ids), "token_ids": ids, "index": turn,
                        "ended": bool(ids) and ids[-1] in params.eos_ids})
        return out

    def _cut_at_stop(self, ids: List[int]) -> List[int]:
        """A turn's ids up to the first token that completes one of the multi-token stop strings
        (the tokens after it are dropped: the turn ended there)."""
        def stopped(n: int) -> bool:  # grows with n: the first n that holds is found by bisection
            text = self.tokenizer.decode(ids[:n])
            return any(s in text for s in self.stop_strings)

        if not self.stop_strings or not stopped(len(ids)):
            return ids
        low, high = 1, len(ids)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if stopped(middle) else (middle + 1, high)
        return ids[:low]

    # -- the environment -------------------------------------------------------------------------

    def _environment_calls(self, trajectories: List[Trajectory], calls: List[tuple], groups, counts, last_turn: bool) -> None:
        """Start or step each of ``trajectories`` (``calls``: (kind, payload) each; a trajectory
        already done is not stepped); on the replica's first rank, the results sent to the others."""
        wanted = [(t, call) for t, call in zip(trajectories, calls) if call[0] == "start" or not t.failure]
        results = None
        if _first_rank(groups):
            results = self._answer(wanted)
        results = _from_first_rank(results, groups)
        for (t, (kind, _)), (observation_ids, done, reward, failure, own_counts) in zip(wanted, results):
            counts["rollout/env_calls"] += 1
            for name, value in own_counts.items():  # the environment's counts (tool calls, ...)
                key = ("time/" if name.endswith("_s") else "rollout/") + name
                counts[key] = counts.get(key, 0.0) + value
            if failure is not None:
                status, reason = failure
                counts["rollout/env_failures"] += 1
                counts["rollout/env_timeouts"] += status == "timeout"
                t.fail(f"{kind}: {reason}")
                continue
            if reward is not None:
                t.turn_rewards.append(reward)
            if done or last_turn or t.done:
                t.done = True
                continue
            ids = t.fitted_observation(observation_ids, self.config.rollout.max_observation_tokens)
            room = self.context - len(t.tokens) - 1  # a reply with no room for the model to answer ends it
            if len(ids) > room:
                t.done = True
                counts["rollout/context_truncated"] += 1
                continue
            t.append_observation(ids)

    def _answer(self, wanted: List[tuple]) -> List[tuple]:
        """(observation ids, done, reward, failure: None or (kind, reason), the environment's
        counts) per call, from the environment pool."""
        if self.pool is None:
            r = self.config.rollout
            self.pool = EnvironmentPool(self.spec, r.env_workers, r.env_timeout_s, self.options)
        requests = [(t.index, kind, payload) for t, (kind, payload) in wanted]
        out = []
        for (t, (kind, payload)), (status, value) in zip(wanted, self.pool.call(requests)):
            if status != "ok":
                out.append(([], True, None, (status, value), {}))
                continue
            observation, done, reward = (value, False, None) if kind == "start" else (value.observation, value.done, value.reward)
            own_counts = value.info.get("counts", {}) if kind == "step" else {}
            turn_ids = payload["token_ids"] if kind == "step" else []
            try:
                ids = self.encoder.encode(observation, turn_ids, self.tokenizer.eos_ids)
            except ValueError as e:
                out.append(([], True, None, ("protocol", f"its observation could not be encoded ({e})"), own_counts))
                continue
            out.append((ids, done, reward, None, own_counts))
        return out

    def _release(self, trajectories: List[Trajectory], groups) -> None:
        if self.pool is not None and _first_rank(groups):
            self.pool.release([t.index for t in trajectories])

    def _metrics(self, trajectories: List[Trajectory], counts: Dict[str, float], env_s: float) -> Dict[str, float]:
        model = sum(sum(t.mask) for t in trajectories)
        after_prompt = sum(len(t.tokens) - t.prompt_length for t in trajectories)
        return {**counts, "rollout/truncated_observations": float(sum(t.truncated_observations for t in trajectories)),
                "rollout/turns_mean": sum(t.turns for t in trajectories) / len(trajectories),
                "rollout/model_token_share": model / max(after_prompt, 1), "time/env_s": env_s}


def _every_one_failed(trajectories: List[Trajectory], device: torch.device) -> bool:
    """Whether every trajectory of the batch failed, over every rank (all of them decide alike, so
    none waits in a collective for a rank that stopped)."""
    counts = torch.tensor([sum(bool(t.failure) for t in trajectories), len(trajectories)], device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    return int(counts[0]) == int(counts[1])


def _first_rank(groups) -> bool:
    """Whether this rank is its policy replica's first (pipeline stage 0, tensor rank 0): the one
    that calls the environment."""
    return groups.tp.rank() == 0 and groups.pp.rank() == 0


def _from_first_rank(value, groups):
    """``value`` of the replica's first rank (pipeline stage 0, tensor rank 0) on every rank of it."""
    box = [value]
    if groups.pp.size() > 1:
        dist.broadcast_object_list(box, src=global_rank(groups.pp, 0), group=groups.pp)
    if groups.tp.size() > 1:
        dist.broadcast_object_list(box, src=global_rank(groups.tp, 0), group=groups.tp)
    return box[0]


def _rows(trajectories: List[Trajectory], prompt_index: torch.Tensor, pad_id: int) -> SampleRows:
    """Sample rows of the trajectories: tokens [B, S], prompt and response lengths [B], the loss
    mask ``action_mask`` [B, S-1] (1 where the action emitted a model token), turn rewards [B]."""
    width = max(len(t.tokens) for t in trajectories)
    tokens = torch.full((len(trajectories), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(trajectories), width, dtype=torch.float32)
    for row, t in enumerate(trajectories):
        tokens[row, : len(t.tokens)] = torch.tensor(t.tokens)
        mask[row, : len(t.mask)] = torch.tensor(t.mask, dtype=torch.float32)
    device = prompt_index.device
    return {
        "tokens": tokens.to(device),
        "prompt_lengths": torch.tensor([t.prompt_length for t in trajectories], device=device),
        "response_lengths": torch.tensor([len(t.tokens) - t.prompt_length for t in trajectories], device=device),
        "action_mask": mask[:, 1:].to(device),
        "turn_rewards": torch.tensor([sum(t.turn_rewards) for t in trajectories], dtype=torch.float32, device=device),
        "prompt_index": prompt_index,
    }
