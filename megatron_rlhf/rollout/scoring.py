"""Scores of a rollout's responses: the rule reward (functions in the reward pool's workers, run on
the first rank of each model-parallel group and sent to its peers) or the reward model (a scalar
head at the last token), plus the judge's weighted verdicts (rollout/judging.py), checked against
reward.max_abs_score, plus DAPO's overlong penalty."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rlhf import ppo
from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.errors import RewardFunctionError
from megatron_rlhf.rewards.pool import RewardPool, check_scores
from megatron_rlhf.roles import inference
from megatron_rlhf.roles.role_set import RoleSet
from megatron_rlhf.roles.rows import SampleRows
from megatron_rlhf.runtime.host_groups import host_group

# The sample rows' column of a process reward model's step scores as per-action rewards (step_aggregation token).
STEP_REWARDS = "step_rewards"


def scores_here() -> bool:
    """Whether this rank runs the rule rewards (and holds their pool): its model-parallel group's
    first rank, which sends the scores to the others."""
    from megatron.core import parallel_state as ps

    return ps.get_model_parallel_group().rank() == 0


def rule_reward_pool(config: RLHFConfig, functions: Optional[Dict[str, float]]) -> Optional[RewardPool]:
    """The rule rewards' worker pool on the ranks that score (scores_here), else None; its workers
    load the functions (checked at start-up) while the roles are built."""
    if not functions or not scores_here():
        return None
    r = config.reward
    return RewardPool(functions, num_workers=r.num_workers, timeout_s=r.timeout_s, failure_score=r.failure_score,
                      wait=False)


def overlong_penalty(config: RLHFConfig, rows: SampleRows) -> torch.Tensor:
    """DAPO's soft overlong penalty [B] of the rows, over the tokens the model wrote (a
    trajectory's turns, not the environment's replies) against config.model_token_budget."""
    alg = config.algorithm
    written = rows["action_mask"].sum(dim=1) if "action_mask" in rows else rows["response_lengths"]
    return ppo.overlong_penalty(written, config.model_token_budget, alg.overlong_buffer_length,
                                alg.overlong_penalty_factor)


def closed_turns(tokens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, tail: List[int],
                 end_ids, pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows as a reward model trained on rendered chats reads them, and where each is scored: a
    response that stopped at an end token gets ``tail`` (tokenizer.turn_tail: what the chat template
    writes after the token, e.g. ChatML's newline) and is scored at its last id, the position where
    the rm stage scored the same conversation; another (cut at the length limit) at its last token.
    tokens [B, S] -> (tokens [B, S'], the scored positions [B])."""
    last = (prompt_lengths + response_lengths - 1).clamp(min=0)
    if not tail:
        return tokens, last
    ended = (response_lengths > 0) & torch.isin(tokens.gather(1, last.unsqueeze(1)).squeeze(1),
                                                torch.tensor(list(end_ids), device=tokens.device))
    width = max(tokens.shape[1], int(last.max()) + 1 + len(tail))
    closed = torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=pad_id)
    rows = ended.nonzero().flatten()
    for offset, token in enumerate(tail, start=1):
        closed[rows, last[rows] + offset] = token
    return closed, last + ended.long() * len(tail)


def step_ends(tokens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
              separator: List[int]) -> torch.Tensor:
    """[B, S] True at the last token of each step of each response: where each occurrence of the
    ``separator`` ids ends (read left to right, not overlapping), and at the response's last token
    (its last step, separator or not)."""
    ends = torch.zeros(tokens.shape, dtype=torch.bool)
    n = len(separator)
    for row, (ids, start, length) in enumerate(zip(tokens.tolist(), prompt_lengths.tolist(), response_lengths.tolist())):
        position = start
        while position + n <= start + length:
            if ids[position : position + n] == separator:
                ends[row, position + n - 1] = True
                position += n
            else:
                position += 1
        if length:
            ends[row, start + length - 1] = True
    return ends.to(tokens.device)


class Scorer:
    """``reward_pool``: the rule functions' pool on the first rank of each model-parallel group
    (None elsewhere, and with a reward model); ``judge``: the LLM judge (rollout/judging.py), None
    without one."""

    def __init__(self, config: RLHFConfig, roles: RoleSet, reward_pool: Optional[RewardPool], judge=None,
                 tokenizer=None):
        self.config = config
        self.roles = roles
        self.reward_pool = reward_pool
        self.judge = judge
        # reward.normalize: the (mean, std) the reward model's checkpoint records (checked at start-up)
        self.normalization = None
        if config.reward.step_separator is not None:  # a process reward model's steps end with its ids
            self.separator = tokenizer.encode_text(config.reward.step_separator)
        # a reward model scores chats where the rm stage did: after the template's close of the turn
        self.turn_tail = tokenizer.turn_tail() if tokenizer is not None and config.reward.type == "model" \
            and config.data.apply_chat_template else []
        self.end_ids, self.pad_id = (tokenizer.eos_ids, tokenizer.pad_id) if tokenizer is not None else ((), 0)
        if config.reward.type == "model" and config.reward.normalize:
            from megatron_rlhf.checkpoint.model_files import recorded_scores

            self.normalization = recorded_scores(config.path_of("reward.load"))

    def score(self, prompts: List[str], responses: List[str], fields: List[Dict], rows: SampleRows,
              iteration: int) -> Tuple[torch.Tensor, Dict[str, float]]:
        """[B] scores of the sample ``rows`` (on the rows' device; an environment's per-turn rewards
        added) and the rule reward's metrics (failures, sub-scores; none for a reward model)."""
        metrics: Dict[str, float] = {}
        if self.config.reward.type == "function":
            scores, metrics = self._rule_scores(prompts, responses, fields)
        elif self.config.reward.step_separator is not None:
            scores, metrics = self._process_reward_scores(rows)
        elif self.config.reward.type == "model":
            scores = self._reward_model_scores(rows)
        else:
            scores = torch.zeros(len(responses))
        scores = scores.to(rows["tokens"].device)
        if self.judge is not None:  # after the reward's phase: PHASE_ORDER
            judged, judge_metrics = self.judge.scores(prompts, responses, fields, iteration)
            scores = scores + self.config.judge.weight * judged.to(scores.device)
            metrics.update(judge_metrics)
        if "turn_rewards" in rows:  # an environment's per-turn rewards count towards the trajectory's score
            scores = scores + rows["turn_rewards"]
        check_scores(scores, self.config.reward.max_abs_score, iteration, prompts)
        alg = self.config.algorithm
        if alg.overlong_buffer_length:
            scores = scores + overlong_penalty(self.config, rows).to(scores.device)
        return scores, metrics

    def _reward_model_scores(self, rows: SampleRows) -> torch.Tensor:
        """[B] the reward model's score at each row's last token, as the rm stage scored a
        conversation: after the chat template's close of the turn (closed_turns)."""
        tokens, last = closed_turns(rows["tokens"], rows["prompt_lengths"], rows["response_lengths"], self.turn_tail,
                                    self.end_ids, self.pad_id)

        def run(mine: SampleRows) -> SampleRows:
            with self.roles.resident("reward", "inference"):
                return {"scores": inference.scores(self.roles["reward"], mine["tokens"], mine["last_index"])}

        scores = self.roles.at_layout("reward", run, {"tokens": tokens, "last_index": last}, tokens.shape[1])["scores"]
        if self.normalization is not None:
            mean, std = self.normalization
            scores = (scores - mean) / std
        return scores

    def _process_reward_scores(self, rows: SampleRows) -> Tuple[torch.Tensor, Dict[str, float]]:
        """[B] a process reward model's aggregated step scores (each sigmoid of its score at the step's
        last token) and their metrics; with step_aggregation token, also rows[STEP_REWARDS] [B, S-1]:
        each step's score at the action that wrote its last token."""
        reward = self.config.reward

        def run(mine: SampleRows) -> SampleRows:
            with self.roles.resident("reward", "inference"):
                lengths = mine["prompt_lengths"] + mine["response_lengths"]
                return {"step_scores": inference.token_scores(self.roles["reward"], mine["tokens"], lengths)}

        columns = {k: rows[k] for k in ("tokens", "prompt_lengths", "response_lengths")}
        width = rows["tokens"].shape[1]
        probabilities = torch.sigmoid(self.roles.at_layout("reward", run, columns, width)["step_scores"][:, :width])
        ends = step_ends(rows["tokens"], rows["prompt_lengths"], rows["response_lengths"], self.separator)
        scores = ppo.STEP_AGGREGATIONS[reward.step_aggregation](probabilities, ends)
        at_ends = probabilities * ends
        if reward.step_aggregation == "token":
            rows[STEP_REWARDS] = at_ends[:, 1:]  # token t is written by action t-1
        steps = ends.sum(dim=1).float()
        return scores, {"reward/steps": float(steps.mean()),
                        "reward/step_score": float(at_ends.sum() / steps.sum().clamp(min=1))}

    def _rule_scores(self, prompts: List[str], responses: List[str], fields: List[Dict]):
        """The rule reward's (scores, metrics), computed on the first rank of the model-parallel group."""
        return pool_scores(self.reward_pool, prompts, responses, fields)


def pool_scores(pool: Optional[RewardPool], prompts: List[str], responses: List[str], fields: List[Dict]):
    """``pool.score``'s (scores, metrics), computed on the first rank of the model-parallel group (the
    one that holds the pool: scores_here) and sent to the others: every rank of a replica holds the
    same rows, and a time-out on one of them must not give its TP or PP peers other scores."""
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    result = [None]
    if scores_here():
        try:
            result = [pool.score(prompts, responses, fields)]
        except RewardFunctionError as e:  # the peers learn it too, so none waits for scores
            result = [e]
    if group.size() > 1:
        dist.broadcast_object_list(result, src=dist.get_global_rank(group, 0), group=host_group(group))
    if isinstance(result[0], RewardFunctionError):
        raise RewardFunctionError(str(result[0]))
    return result[0]
