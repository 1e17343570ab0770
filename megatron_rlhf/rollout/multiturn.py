"""Multi-turn rollouts: the policy writes a turn, the environment answers, the policy writes again.

Per policy replica, over its rows: every trajectory starts (the environment's first observation
appended to the prompt), then its turns alternate with its environment's replies. Without lockstep
(``rollout.overlap_turns``, the default) a trajectory whose turn ends goes to its environment while
the engine decodes the others, and its next turn joins the running batch as soon as the reply
comes (generation/open_run.py); in lockstep every trajectory's turn runs, then every call. The
environment's calls run concurrently in worker processes on the replica's first rank, each answer
sent to its other ranks as it comes. A turn ends at an end token, at one of ``rollout.stop``'s
tokens, or at ``max_tokens_per_turn``; a trajectory at the environment's ``done``, at
``max_turns``, at ``max_trajectory_tokens`` or when its environment fails (counted, with the
reason). A reply after the last turn is not appended: a trajectory ends with the model's tokens.
Each turn's tokens draw from the response's own stream (keyed by the turn), so the rollout does
not depend on the layout, on the schedule of turns or on which trajectories share a step.

The engine keeps each trajectory's KV cache across its turns (a cache session): a continuing
trajectory feeds only the environment's reply and its own last token. A slot a trajectory left is
kept for it while other slots are free; with fewer decode slots (generation.batch_size) than
trajectories a waiting row takes it, and the trajectory's next turn prefills its prefix again
(``rollout/prefix_recomputed`` counts those prefills).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.errors import RunError
from megatron_rlhf.generation import SamplingParams, stream_seeds
from megatron_rlhf.models.decoder import global_rank, groups_of
from megatron_rlhf.rollout.env_pool import EnvironmentPool
from megatron_rlhf.rollout.record import BEHAVIOUR, COUNTED_METRICS
from megatron_rlhf.roles.rows import SampleRows
from megatron_rlhf.rollout.trajectory import ObservationEncoder, Trajectory, start_call
from megatron_rlhf.runtime.host_groups import host_group

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

    def run(self, collector, mine: SampleRows, texts: List[str], fields: List[Dict], sampling: SamplingParams,
            record_log_probs: bool = False) -> Tuple[SampleRows, Dict[str, float]]:
        """Trajectories for the prompt rows ``mine`` (the policy resident; ``texts`` and ``fields``:
        each row's prompt and data columns); the sample rows (with the loss mask ``action_mask``,
        the per-turn rewards ``turn_rewards`` and with ``record_log_probs`` the engine's log-prob of
        each model token, BEHAVIOUR) and the metrics."""
        lengths = mine["prompt_lengths"].tolist()
        trajectories = [Trajectory(row[:n].tolist(), self.new_id()) for row, n in zip(mine["tokens"].cpu(), lengths)]
        for t, text, row in zip(trajectories, texts, fields):
            t.calls.append(start_call(text, row))
        metrics = self.play(collector, trajectories, mine["seeds"], sampling, record_log_probs)
        return trajectory_rows(trajectories, mine["prompt_index"], self.tokenizer.pad_id, record_log_probs), metrics

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def play(self, collector, trajectories: List[Trajectory], seeds: torch.Tensor, sampling: SamplingParams,
             record_log_probs: bool, chunk_turns: Optional[int] = None,
             enough: Optional[Callable[[List[Trajectory]], bool]] = None) -> Dict[str, float]:
        """Play ``trajectories`` (the policy resident; ``seeds``: their streams): a new one from its
        start, a resumed one (turns taken in an earlier iteration: rollout/partial_turns.py) from
        every call it made, made again to rebuild its environment. Until every one is done; with
        ``chunk_turns``, in chunks of that many turns each, ending after the first chunk where
        ``enough(trajectories)`` (collective; those not done then wait at a turn's start). The metrics."""
        groups = groups_of(collector.roles["policy"].model)
        counts = dict.fromkeys(TURN_COUNTS, 0.0)
        calls = _ReplicaCalls(self, groups, trajectories)
        calls.submit([(i, *t.calls[0]) for i, t in enumerate(trajectories) if not t.turns_before])
        for i, t in enumerate(trajectories):
            if t.turns_before:
                t.replaying = len(t.calls)
                calls.submit([(i, kind, payload) for kind, payload in t.calls], replay=True)
        turn_params = dataclasses.replace(sampling, max_new_tokens=self.turn_tokens,
                                          eos_ids=tuple(dict.fromkeys(sampling.eos_ids + self.stop_ids)))
        with collector.open_run(len(trajectories), turn_params, record_log_probs) as engine:
            limit, parked = chunk_turns, []
            while True:
                parked = self._serve(engine, calls, trajectories, seeds, turn_params, counts, parked, limit)
                if chunk_turns is None or enough(trajectories):
                    break
                limit += chunk_turns
        counts["rollout/slot_occupancy"] = engine.stats.sampled / max(engine.stats.slot_steps, 1)
        self._release(trajectories, groups)
        if _every_one_failed(trajectories, seeds.device):
            first = next((t.failure for t in trajectories if t.failure), "failure was on another rank")
            raise EnvironmentFailure(f"environment {self.spec}: every trajectory of the batch failed; the first "
                                     f"{first}", collective=True)
        return self._metrics(trajectories, counts, calls.waited_s)

    def _serve(self, engine, calls: "_ReplicaCalls", trajectories: List[Trajectory], seeds: torch.Tensor,
               params: SamplingParams, counts: Dict[str, float], ready: List[int],
               turn_limit: Optional[int] = None) -> List[int]:
        """The turns' schedule, from the trajectories ``ready`` to start a turn until every
        trajectory is done or has taken ``turn_limit`` turns: answers applied as they come, the
        next turns started (at once, or in lockstep once every turn and call is over), one engine
        step, the turns that ended sent to their environments. Returns the trajectories that
        stopped at the limit (ready for their next turn)."""
        position = {t.index: i for i, t in enumerate(trajectories)}
        lockstep = not self.config.rollout.overlap_turns
        ready, parked = list(ready), []  # trajectories whose next turn may start; those at the limit
        while True:
            # Wait for an answer only with nothing to run (never with expert-parallel peers to keep pace with).
            block = not engine.busy and calls.outstanding and (not ready or lockstep) and engine.peers is None
            for i, kind, answer, replayed in calls.arrivals(block):
                t = trajectories[i]
                goes_on = self._replayed(t, answer, counts) if replayed else self._answered(t, kind, answer, counts)
                if goes_on is None:
                    continue  # more of its calls to replay
                if not goes_on:
                    engine.release(t.index)
                elif turn_limit is not None and t.turns - t.turns_before >= turn_limit:
                    parked.append(i)
                else:
                    ready.append(i)
            if ready and not (lockstep and (engine.busy or calls.outstanding)):
                self._start_turns(engine, trajectories, sorted(ready), seeds, counts)
                ready = []
            active = engine.busy or calls.outstanding > 0 or bool(ready)
            ended = engine.step(active) if active or engine.peers is not None else None
            if ended is None:
                return sorted(parked)
            for key, ids, log_probs in ended:
                i = position[key]
                self._turn_ended(trajectories[i], ids, log_probs, counts)
                view = self._turn_view(trajectories[i], ids, params)
                trajectories[i].calls.append(("step", view))
                calls.submit([(i, "step", view)])

    def _start_turns(self, engine, trajectories: List[Trajectory], ready: List[int], seeds: torch.Tensor,
                     counts: Dict[str, float]) -> None:
        """The next turn of each of ``ready`` joins the engine's rows, drawing from its own stream
        (turn 0 as a single response would, every later turn from the turn's own)."""
        picked = [trajectories[i] for i in ready]
        own = seeds[torch.tensor(ready, device=seeds.device)]
        turns = torch.tensor([t.turns for t in picked], device=seeds.device)
        turn_seeds = torch.where(turns == 0, own, stream_seeds(own, turns).to(seeds.device))
        resumed = engine.add([t.index for t in picked], [t.tokens for t in picked],
                             [min(self.turn_tokens, self.context - len(t.tokens)) for t in picked], turn_seeds)
        counts["rollout/prefix_recomputed"] += sum(t.turns > 0 for t in picked) - resumed

    def _turn_ended(self, t: Trajectory, ids: List[int], log_probs: Optional[List[float]],
                    counts: Dict[str, float]) -> None:
        """The model's turn ``ids`` (with the engine's ``log_probs`` of them, or None) appended to
        ``t`` (cut after a stop string, in place; the context full ends it)."""
        ids[:] = self._cut_at_stop(ids)
        if len(t.tokens) + len(ids) >= self.context:  # the context is full: the trajectory ends
            t.done = True
            counts["rollout/context_truncated"] += 1
        t.append_model(ids, None if log_probs is None else log_probs[: len(ids)])

    def _turn_view(self, t: Trajectory, ids: List[int], params: SamplingParams) -> dict:
        """The turn as the environment sees it."""
        return {"text": self.tokenizer.decode(ids), "token_ids": ids, "index": t.turns - 1,
                "ended": bool(ids) and ids[-1] in params.eos_ids}

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

    def _answered(self, t: Trajectory, kind: str, answer: tuple, counts: Dict[str, float]) -> bool:
        """The environment's answer to a start or step of ``t`` applied; whether ``t`` goes on."""
        observation_ids, done, reward, failure, own_counts = answer
        counts["rollout/env_calls"] += 1
        t.answers.append([list(observation_ids), bool(done), reward])
        for name, value in own_counts.items():  # the environment's counts (tool calls, ...)
            key = ("time/" if name.endswith("_s") else "rollout/") + name
            counts[key] = counts.get(key, 0.0) + value
        if failure is not None:
            return _failed(t, kind, failure, counts)
        if reward is not None:
            t.turn_rewards.append(reward)
        if done or t.turns >= self.config.rollout.max_turns or t.done:
            t.done = True
            return False
        ids = t.fitted_observation(observation_ids, self.config.rollout.max_observation_tokens)
        room = self.context - len(t.tokens) - 1  # a reply with no room for the model to answer ends it
        if len(ids) > room:
            t.done = True
            counts["rollout/context_truncated"] += 1
            return False
        t.append_observation(ids)
        return True

    def _replayed(self, t: Trajectory, answer: tuple, counts: Dict[str, float]) -> Optional[bool]:
        """An answer to one of the calls that rebuild a resumed ``t``'s environment (its own answer
        was applied when first made, and must be what it answers now): None while more are to
        come, then whether ``t`` goes on."""
        observation_ids, done, reward, failure, _ = answer
        counts["rollout/env_replayed_calls"] += 1
        call = len(t.calls) - t.replaying
        t.replaying -= 1
        if t.failure is not None:
            return None  # an earlier call failed it (and released it)
        if failure is not None:
            return _failed(t, "rebuilding its environment", failure, counts)
        if call < len(t.answers) and [list(observation_ids), bool(done), reward] != t.answers[call]:
            recorded = t.answers[call]
            return _failed(t, "rebuilding its environment", (
                "replay", f"call {call + 1} ({t.calls[call][0]}) answered otherwise than when it was first made "
                f"(observation of {len(observation_ids)} tokens, done {bool(done)}, reward {reward}; first: "
                f"{len(recorded[0])} tokens, done {recorded[1]}, reward {recorded[2]}): a resumed trajectory's "
                "environment must be a function of its calls (seed any randomness from the start's arguments), "
                "and its code unchanged since"), counts)
        return None if t.replaying > 0 else True

    def answer(self, kind: str, payload, outcome) -> tuple:
        """(observation ids, done, reward, failure: None or (kind, reason), the environment's
        counts) of one pool outcome, on the replica's first rank."""
        status, value = outcome
        if status != "ok":
            return [], True, None, (status, value), {}
        observation, done, reward = (value, False, None) if kind == "start" else (value.observation, value.done, value.reward)
        own_counts = value.info.get("counts", {}) if kind == "step" else {}
        turn_ids = payload["token_ids"] if kind == "step" else []
        try:
            ids = self.encoder.encode(observation, turn_ids, self.tokenizer.eos_ids)
        except ValueError as e:
            return [], True, None, ("protocol", f"its observation could not be encoded ({e})"), own_counts
        return ids, done, reward, None, own_counts

    def environment_pool(self) -> EnvironmentPool:
        """The pool (started on the first call, on the replica's first rank)."""
        if self.pool is None:
            r = self.config.rollout
            self.pool = EnvironmentPool(self.spec, r.env_workers, r.env_timeout_s, self.options, r.env_memory_mb)
        return self.pool

    def _release(self, trajectories: List[Trajectory], groups) -> None:
        if self.pool is not None and _first_rank(groups):
            self.pool.release([t.index for t in trajectories])

    def _metrics(self, trajectories: List[Trajectory], counts: Dict[str, float], env_s: float) -> Dict[str, float]:
        model = sum(sum(t.mask) for t in trajectories)
        after_prompt = sum(len(t.tokens) - t.prompt_length for t in trajectories)
        return {**counts, "rollout/truncated_observations": float(sum(t.truncated_observations for t in trajectories)),
                "rollout/turns_mean": sum(t.turns for t in trajectories) / max(len(trajectories), 1),
                "rollout/model_token_share": model / max(after_prompt, 1), "time/env_s": env_s}


class _ReplicaCalls:
    """The environment calls of one batch on a policy replica: every rank submits alike, the
    replica's first rank makes them (the environment pool) and sends each answer to the others as
    it comes. What every rank knows alike: the calls made and how many are unanswered."""

    def __init__(self, turns: "MultiTurn", groups, trajectories: List[Trajectory]):
        self.turns, self.groups, self.trajectories = turns, groups, trajectories
        self.first = _first_rank(groups)
        self.made: List[Tuple[int, str, object]] = []  # (trajectory position, kind, payload), by call
        self.replays: set = set()  # the calls that rebuild a resumed trajectory's environment
        self.tickets: Dict[int, int] = {}  # the pool's ticket -> call (first rank)
        self.outstanding = 0
        self.waited_s = 0.0  # time the replica waited for an answer with nothing else to run
        if self.first:
            turns.environment_pool().begin()

    def submit(self, calls: List[Tuple[int, str, object]], replay: bool = False) -> None:
        first = len(self.made)
        if replay:
            self.replays.update(range(first, first + len(calls)))
        self.made += calls
        self.outstanding += len(calls)
        if self.first:
            requests = [(self.trajectories[i].index, kind, payload) for i, kind, payload in calls]
            for call, ticket in enumerate(self.turns.pool.submit(requests), first):
                self.tickets[ticket] = call

    def arrivals(self, block: bool) -> List[Tuple[int, str, tuple, bool]]:
        """The answers come so far (waiting for one with ``block``): (trajectory position, kind,
        answer, whether the call was a replay) each, on every rank of the replica."""
        if not self.outstanding:
            return []
        started = time.perf_counter()
        answered = None
        if self.first:
            answered = []
            for ticket, outcome in self.turns.pool.poll(None if block else 0.0):
                call = self.tickets.pop(ticket)
                _, kind, payload = self.made[call]
                answered.append((call, self.turns.answer(kind, payload, outcome)))
        answered = _from_first_rank(answered, self.groups)
        if block:
            self.waited_s += time.perf_counter() - started
        self.outstanding -= len(answered)
        return [(self.made[call][0], self.made[call][1], answer, call in self.replays) for call, answer in answered]


def _failed(t: Trajectory, what: str, failure: Tuple[str, str], counts: Dict[str, float]) -> bool:
    """``t`` failed in its environment (``failure``: the outcome's kind and reason), counted; False:
    it does not go on."""
    status, reason = failure
    counts["rollout/env_failures"] += 1
    counts["rollout/env_timeouts"] += status == "timeout"
    t.fail(f"{what}: {reason}")
    return False


def _every_one_failed(trajectories: List[Trajectory], device: torch.device) -> bool:
    """Whether every trajectory of the batch failed, over every rank (all of them decide alike, so
    none waits in a collective for a rank that stopped)."""
    counts = torch.tensor([sum(bool(t.failure) for t in trajectories), len(trajectories)], device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    return 0 < int(counts[1]) == int(counts[0])


def _first_rank(groups) -> bool:
    """Whether this rank is its policy replica's first (pipeline stage 0, tensor rank 0): the one
    that calls the environment."""
    return groups.tp.rank() == 0 and groups.pp.rank() == 0


def _from_first_rank(value, groups):
    """``value`` of the replica's first rank (pipeline stage 0, tensor rank 0) on every rank of it."""
    box = [value]
    if groups.pp.size() > 1:
        dist.broadcast_object_list(box, src=global_rank(groups.pp, 0), group=host_group(groups.pp))
    if groups.tp.size() > 1:
        dist.broadcast_object_list(box, src=global_rank(groups.tp, 0), group=host_group(groups.tp))
    return box[0]


def trajectory_rows(trajectories: List[Trajectory], prompt_index: torch.Tensor, pad_id: int, behaviour: bool) -> SampleRows:
    """Sample rows of the trajectories: tokens [B, S], prompt and response lengths [B], the loss
    mask ``action_mask`` [B, S-1] (1 where the action emitted a model token), turn rewards [B];
    with ``behaviour`` the engine's log-prob of each action [B, S-1] (0 where no model token)."""
    width = max(len(t.tokens) for t in trajectories)
    tokens = torch.full((len(trajectories), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(trajectories), width, dtype=torch.float32)
    log_probs = torch.zeros(len(trajectories), width, dtype=torch.float32)
    for row, t in enumerate(trajectories):
        tokens[row, : len(t.tokens)] = torch.tensor(t.tokens)
        mask[row, : len(t.mask)] = torch.tensor(t.mask, dtype=torch.float32)
        log_probs[row, : len(t.behaviour)] = torch.tensor(t.behaviour, dtype=torch.float32)
    device = prompt_index.device
    rows = {
        "tokens": tokens.to(device),
        "prompt_lengths": torch.tensor([t.prompt_length for t in trajectories], device=device),
        "response_lengths": torch.tensor([len(t.tokens) - t.prompt_length for t in trajectories], device=device),
        "action_mask": mask[:, 1:].to(device),
        "turn_rewards": torch.tensor([sum(t.turn_rewards) for t in trajectories], dtype=torch.float32, device=device),
        "prompt_index": prompt_index,
    }
    if behaviour:  # the token at position p is the action at p - 1's
        rows[BEHAVIOUR] = log_probs[:, 1:].to(device)
    return rows
