"""Partial rollouts with an environment: the long tail of trajectories stops costing the iteration.

As single-turn partial rollouts (rollout/partial.py), with a turn as the unit: trajectories for
``over_sample`` x rollout_batch_size prompts are in flight each round, the held ones first (oldest
first), then new prompts. Every trajectory takes ``chunk_turns`` turns (and its environment's
replies) between the checks; after each chunk the ranks count the groups whose trajectories have
all ended, and the round stops once rollout_batch_size groups have. The first of them, in pool
order, are this round's rows; the rest are held in the run's state (checkpointed) with their
tokens, loss mask, the engine's log-probs (behaviour), the iteration each model token was sampled
in, their turns and rewards so far, and the environment calls they made. A held trajectory resumes
at the start of its next turn, its environment rebuilt in a fresh instance by making its calls
again (environments are deterministic functions of their calls, as agents/protocol.py asks; counted
as rollout/env_replayed_calls). A held group older than ``max_staleness`` iterations is dropped.

Where a round stops is a number of chunks, decided from every trajectory's turns, and every turn
draws from its trajectory's own stream (keyed by the turn): the rows do not depend on the layout or
on the schedule of turns, and with weights that do not change a trajectory resumed over several
iterations is the one of one go.
"""

from __future__ import annotations

import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron_rlhf.rollout.multiturn import trajectory_rows
from megatron_rlhf.rollout.partial import HeldGroups
from megatron_rlhf.rollout.record import Prompts
from megatron_rlhf.rollout.trajectory import Trajectory, start_call
from megatron_rlhf.roles.rows import SampleRows, trimmed
from megatron_rlhf.runtime.host_groups import host_group

Held = Dict  # a held trajectory: {"state": Trajectory.state(), "seed": int, "prompt_index": int}


class PartialTrajectories(HeldGroups):
    """The held trajectories (a list of Held, in pool order, a group's adjacent) and the rounds
    that resume them; ``collector.turns`` plays them."""

    def _held_rows(self) -> int:
        return len(self.held)

    # -- a round ---------------------------------------------------------------------------------

    def rows(self, dataset, iteration: int, round_: int) -> Tuple[SampleRows, Dict[str, float]]:
        """This rank's share (the run's cut) of a round's rollout_batch_size ended groups, with the
        policy's old log-probs and the behaviour log-probs; and the round's metrics."""
        cfg = self.config
        samples = cfg.generation.samples_per_prompt
        held, dropped = self._fresh(iteration)
        resumed = sum(not h["state"]["done"] for h in held)
        pool = held + self._new(dataset, cfg.rollout.partial.pool_groups(cfg.ppo.rollout_batch_size) - len(held) // samples,
                                iteration, round_)
        out: Dict[str, float] = {}

        def run(mine: SampleRows) -> SampleRows:
            cut = self.roles.cuts["policy"]
            positions = mine["pool_position"].tolist()
            with self.roles.resident("policy", "inference"):
                started = time.perf_counter()
                played, chunks, metrics = self._play([pool[p] for p in positions], iteration, cut)
                out["time/generate_s"] = time.perf_counter() - started
                everything = _gathered(list(zip(positions, played)), cut)
                picked = self._hold_the_rest(everything)
                rows = trajectory_rows([Trajectory.from_state(e["state"], 0, iteration) for e in picked],
                                       torch.tensor([e["prompt_index"] for e in picked], device=self.collector.device),
                                       self.collector.sampling.pad_id, behaviour=True)
                rows["versions"] = _versions(picked, rows["tokens"].shape[1] - 1).to(self.collector.device)
                rows["seeds"] = torch.tensor([e["seed"] for e in picked], device=self.collector.device)
                selected = trimmed(cut.share(rows))
                self.collector.add_old_log_probs(selected, cfg.moe.routing_replay)
            if cut != self.roles.cut:
                metrics = self.collector.as_run_share(metrics)
            out.update(metrics, **self._figures(rows["versions"], iteration, chunks))
            return selected

        columns = {"pool_position": torch.arange(len(pool), device=self.collector.device)}
        rows = self.roles.at_layout("policy", run, self.roles.cut.share(columns))
        rows.pop("versions")
        first = float(self.roles.cut.rank == 0)  # counts over the whole pool, reported by one rank
        out.update({"rollout/partial_dropped": first * dropped, "rollout/partial_resumed": first * resumed})
        return rows, out

    def _fresh(self, iteration: int) -> Tuple[List[Held], int]:
        """The held groups young enough to be resumed, and how many trajectories were dropped."""
        if self.held is None:
            return [], 0
        samples, limit = self.config.generation.samples_per_prompt, self.config.rollout.partial.max_staleness
        kept = []
        for g in range(0, len(self.held), samples):
            group = self.held[g : g + samples]
            born = min((min((v for v in h["state"]["versions"] if v >= 0), default=iteration) for h in group))
            if iteration - born <= limit:
                kept += group
        return kept, len(self.held) - len(kept)

    def _new(self, dataset, groups: int, iteration: int, round_: int) -> List[Held]:
        """Trajectories for ``groups`` new prompts (every rank: the whole pool's), each with its
        environment's start as its first call."""
        if groups <= 0:
            return []
        samples = self.config.generation.samples_per_prompt
        prompts = Prompts.expand(dataset.next_batch(groups, 0, 1), samples, self.config.seed, iteration, round_,
                                 torch.device("cpu"))
        new = []
        for row, length, seed, index, text, fields in zip(prompts.tokens, prompts.prompt_lengths.tolist(),
                                                           prompts.seeds.tolist(), prompts.prompt_index.tolist(),
                                                           prompts.texts, prompts.fields):
            t = Trajectory(row[:length].tolist(), 0)
            t.calls.append(start_call(text, fields))
            new.append({"state": t.state(), "seed": seed, "prompt_index": index})
        return new

    def _play(self, entries: List[Held], iteration: int, cut) -> Tuple[List[Held], int, Dict[str, float]]:
        """Play this rank's ``entries`` chunk by chunk until enough groups have ended over every
        rank; the entries as they stand then, the chunks run and the turns' metrics."""
        turns, cfg = self.collector.turns, self.config
        samples, need = cfg.generation.samples_per_prompt, cfg.ppo.rollout_batch_size
        trajectories = [Trajectory.from_state(e["state"], turns.new_id(), iteration) for e in entries]
        live = [i for i, t in enumerate(trajectories) if not t.done]
        chunks = 0

        def enough(_) -> bool:
            nonlocal chunks
            chunks += 1
            ended = cut.gather_tensor(torch.tensor([t.done for t in trajectories], device=self.collector.device))
            return int(ended.view(-1, samples).all(dim=1).sum()) >= need or bool(ended.all())

        seeds = torch.tensor([entries[i]["seed"] for i in live], dtype=torch.long, device=self.collector.device)
        metrics = turns.play(self.collector, [trajectories[i] for i in live], seeds, self.collector.sampling,
                             record_log_probs=True, chunk_turns=cfg.rollout.partial.turns_per_chunk(), enough=enough)
        played = [{**e, "state": t.state()} for e, t in zip(entries, trajectories)]
        return played, chunks, metrics

    def _hold_the_rest(self, pool: List[Held]) -> List[Held]:
        """The round's trajectories: the first rollout_batch_size groups of ``pool`` whose
        trajectories have all ended, in pool order; the other groups are held."""
        samples, need = self.config.generation.samples_per_prompt, self.config.ppo.rollout_batch_size
        groups = [pool[g : g + samples] for g in range(0, len(pool), samples)]
        complete = [g for g, group in enumerate(groups) if all(h["state"]["done"] for h in group)][:need]
        self.held = [h for g, group in enumerate(groups) if g not in complete for h in group] or None
        return [h for g in complete for h in groups[g]]

    def _figures(self, versions: torch.Tensor, iteration: int, chunks: int) -> Dict[str, float]:
        """The round's figures (the same on every rank): the staleness of the tokens trained
        (iterations since each was sampled), the groups held, the chunks run."""
        sampled = versions >= 0
        staleness = (iteration - versions).masked_fill(~sampled, 0).sum() / sampled.sum().clamp(min=1)
        return {"rollout/staleness_mean": float(staleness), "rollout/partial_held_groups": float(self.held_groups),
                "rollout/partial_chunks": float(chunks)}


def _gathered(mine: List[Tuple[int, Held]], cut) -> List[Held]:
    """Every rank's played entries (position, entry), in pool order, on every rank."""
    everyone = [mine]
    if cut.size > 1:
        everyone = [None] * cut.size
        dist.all_gather_object(everyone, mine, group=host_group(cut.group))
    return [entry for _, entry in sorted((pair for part in everyone for pair in part), key=lambda pair: pair[0])]


def _versions(entries: List[Held], width: int) -> torch.Tensor:
    """The iteration each action's token was sampled in [B, width] (-1: not the model's)."""
    out = torch.full((len(entries), width), -1, dtype=torch.long)
    for row, e in enumerate(entries):
        versions = e["state"]["versions"][1:]  # the token at position p is the action at p - 1's
        out[row, : len(versions)] = torch.tensor(versions, dtype=torch.long)
    return out
