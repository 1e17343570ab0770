"""Partial rollouts (slime's APRIL, verl's colocate_async): the long tail of response lengths stops
costing the iteration.

Responses to ``over_sample`` x rollout_batch_size prompts are in flight each round: the groups held
from earlier iterations first (oldest first), then new prompts. Every response generates
``chunk_tokens`` at a time (its KV cache kept between chunks, its stream drawn on where it stopped);
after each chunk the ranks count the groups whose responses have all ended, and generation stops
once rollout_batch_size groups have. The first of them, in pool order, are this round's rows; the
rest (unfinished, or ended beyond the batch) keep their tokens, the engine's log-probs of them
(the behaviour policy's, for rollout correction) and the iteration each token was sampled in, and
are held in the run's state (checkpointed) until the next round. A held group older than
``max_staleness`` iterations is dropped (counted).

Where generation stops is a number of chunks, decided from every response's tokens, and every
response draws from its own stream: the rows do not depend on the DP layout or the decode batch,
and with weights that do not change, a response resumed over several iterations has the tokens it
would have had in one go.
"""

from __future__ import annotations

import time
from typing import Dict, Optional, Tuple

import torch

from megatron_rlhf.rollout.record import BEHAVIOUR, Prompts
from megatron_rlhf.roles.rows import RowCut, SampleRows, cat_rows, trimmed


class HeldGroups:
    """What partial rollouts keep in the run's state (checkpointed): the groups held for the next
    round, every rank all of them, on the host (None: none). Of responses here, of trajectories
    with an environment (rollout/partial_turns.py)."""

    def __init__(self, config, collector):
        self.config = config
        self.collector = collector
        self.roles = collector.roles
        self.held = None

    def state_dict(self) -> Dict:
        return {"held": self.held}

    def load_state_dict(self, state: Dict) -> None:
        self.held = state["held"]

    @property
    def held_groups(self) -> int:
        return 0 if self.held is None else self._held_rows() // self.config.generation.samples_per_prompt

    def _held_rows(self) -> int:
        raise NotImplementedError


class PartialRollouts(HeldGroups):
    """The held groups of responses (SampleRows) and the rounds that resume them."""

    def _held_rows(self) -> int:
        return len(self.held["seeds"])

    # -- a round ---------------------------------------------------------------------------------

    def rows(self, dataset, iteration: int, round_: int) -> Tuple[SampleRows, Dict[str, float]]:
        """This rank's share (the run's cut) of a round's rollout_batch_size ended groups, with the
        policy's old log-probs and the behaviour log-probs; and the round's metrics."""
        cfg = self.config
        samples, partial = cfg.generation.samples_per_prompt, cfg.rollout.partial
        held, dropped = self._fresh(iteration)
        resumed = 0 if held is None else int((held["ended"] == 0).sum())
        new = partial.pool_groups(cfg.ppo.rollout_batch_size) - (0 if held is None else len(held["seeds"]) // samples)
        parts = [held] if held is not None else []
        if new > 0:
            batch = dataset.next_batch(new, 0, 1)  # every rank: the whole pool
            parts.append(self._new_rows(Prompts.expand(batch, samples, cfg.seed, iteration, round_, torch.device("cpu"))))
        pool = cat_rows(parts, self.collector.sampling.pad_id, cfg.sequence_tokens)
        out: Dict[str, float] = {}

        def run(mine: SampleRows) -> SampleRows:
            cut = self.roles.cuts["policy"]
            with self.roles.resident("policy", "inference"):
                started = time.perf_counter()
                chunks = self._generate(mine, iteration, cut)
                out["time/generate_s"] = time.perf_counter() - started
                everything = cut.gather(mine, self.collector.sampling.pad_id)
                picked = self._hold_the_rest(everything)
                selected = trimmed(cut.share({k: v[picked] for k, v in everything.items()}))
                self.collector.add_old_log_probs(selected, self.config.moe.routing_replay)
            out.update(self._figures(everything, picked, iteration, chunks))
            return selected

        device = self.collector.device
        rows = self.roles.at_layout("policy", run, self.roles.cut.share({k: v.to(device) for k, v in pool.items()}))
        for name in ("versions", "ended"):
            rows.pop(name)
        # Counts over the whole pool: reported by one rank (the DP sum adds the others' zeros).
        first = float(self.roles.cut.rank == 0)
        out.update({"rollout/partial_dropped": first * dropped, "rollout/partial_resumed": first * resumed})
        return rows, out

    def _fresh(self, iteration: int) -> Tuple[Optional[SampleRows], int]:
        """The held groups young enough to be resumed, and how many responses were dropped."""
        if self.held is None:
            return None, 0
        samples = self.config.generation.samples_per_prompt
        first_version = self.held["versions"].masked_fill(self.held["versions"] < 0, 1 << 62).amin(dim=1)
        born = first_version.view(-1, samples).amin(dim=1)  # a group's responses start together
        young = (iteration - born <= self.config.rollout.partial.max_staleness).repeat_interleave(samples)
        dropped = int((~young).sum())
        held = {k: v[young] for k, v in self.held.items()}
        return (held if len(held["seeds"]) else None), dropped

    def _new_rows(self, prompts: Prompts) -> SampleRows:
        """The pool's rows of new prompts, as wide as any row gets (versions -1: nothing sampled)."""
        rows, width = len(prompts.seeds), self.config.sequence_tokens
        tokens = torch.full((rows, width), self.collector.sampling.pad_id, dtype=torch.long)
        tokens[:, : prompts.tokens.shape[1]] = prompts.tokens
        return {"tokens": tokens, "prompt_lengths": prompts.prompt_lengths,
                "response_lengths": torch.zeros(rows, dtype=torch.long), "seeds": prompts.seeds,
                "prompt_index": prompts.prompt_index, BEHAVIOUR: torch.zeros(rows, width - 1),
                "versions": torch.full((rows, width - 1), -1, dtype=torch.long),
                "ended": torch.zeros(rows, dtype=torch.long)}

    def _generate(self, mine: SampleRows, iteration: int, cut: RowCut) -> int:
        """Generate ``mine`` (this rank's share of the pool, in the policy's cut; updated in place)
        chunk by chunk until enough groups have ended over every rank; the chunks run."""
        cfg, collector = self.config, self.collector
        samples, need = cfg.generation.samples_per_prompt, cfg.ppo.rollout_batch_size
        chunk, budget = cfg.rollout.partial.chunk(cfg.generation), cfg.generation.max_new_tokens
        eos = torch.tensor(collector.sampling.eos_ids, dtype=torch.long, device=mine["tokens"].device)
        keys = mine["seeds"].tolist()
        chunks = 0
        with collector.cache_session(len(keys)) as session:
            while True:
                live = (mine["ended"] == 0).nonzero().flatten().tolist()
                if live:
                    self._chunk(mine, live, [keys[i] for i in live], chunk, budget, eos, iteration, session)
                chunks += 1
                ended = cut.gather_tensor(mine["ended"])
                if int(ended.view(-1, samples).all(dim=1).sum()) >= need or bool(ended.all()):
                    return chunks

    def _chunk(self, mine: SampleRows, live, keys, chunk: int, budget: int, eos: torch.Tensor, iteration: int,
               session) -> None:
        """The next ``chunk`` tokens (at most) of the rows ``live`` of ``mine``, written into it."""
        starts = (mine["prompt_lengths"][live] + mine["response_lengths"][live]).tolist()
        done = mine["response_lengths"][live].tolist()
        sub = {"tokens": mine["tokens"][live][:, : max(starts)], "prompt_lengths": torch.tensor(starts),
               "seeds": mine["seeds"][live]}
        gen = self.collector.engine(sub, self.collector.sampling, max_new_tokens=[min(chunk, budget - d) for d in done],
                                    session=session, keys=keys, start_counters=done, record_log_probs=True)
        for row, (i, start, new) in enumerate(zip(live, starts, gen.response_lengths.tolist())):
            mine["tokens"][i, start : start + new] = gen.tokens[row, start : start + new]
            mine[BEHAVIOUR][i, start - 1 : start - 1 + new] = gen.log_probs[row, start - 1 : start - 1 + new]
            mine["versions"][i, start - 1 : start - 1 + new] = iteration
        rows = torch.tensor(live, device=eos.device)
        lengths = mine["response_lengths"][rows] + gen.response_lengths
        last = gen.tokens[torch.arange(len(live), device=eos.device), gen.total_lengths - 1]
        mine["response_lengths"][rows] = lengths
        mine["ended"][rows] = (torch.isin(last, eos) | (lengths >= budget)).long()

    def _hold_the_rest(self, pool: SampleRows) -> torch.Tensor:
        """The rows of the round: the first rollout_batch_size groups of ``pool`` whose responses
        have all ended, in pool order; the other groups are held (on the host). Returns the rows'
        indices."""
        samples, need = self.config.generation.samples_per_prompt, self.config.ppo.rollout_batch_size
        complete = pool["ended"].view(-1, samples).all(dim=1)
        chosen = torch.zeros_like(complete)
        chosen[complete.nonzero().flatten()[:need]] = True
        rows = chosen.repeat_interleave(samples)
        self.held = {k: v[~rows].cpu() for k, v in pool.items()} if not rows.all() else None
        return rows.nonzero().flatten()

    def _figures(self, pool: SampleRows, picked: torch.Tensor, iteration: int, chunks: int) -> Dict[str, float]:
        """The round's figures over the whole pool (the same on every rank): the staleness of the
        tokens trained (iterations since each was sampled), the groups held, the chunks run."""
        versions = pool["versions"][picked]
        sampled = versions >= 0
        staleness = (iteration - versions).masked_fill(~sampled, 0).sum() / sampled.sum().clamp(min=1)
        return {"rollout/staleness_mean": float(staleness), "rollout/partial_held_groups": float(self.held_groups),
                "rollout/partial_chunks": float(chunks)}
