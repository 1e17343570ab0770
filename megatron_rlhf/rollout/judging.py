"""The judge's phase (the judge section): once a round of responses is generated, the judge role
comes onto the device (the policy has left it: EMS) and reads each response in its template, with
the prompt and the row's reference; the engine writes its verdicts (one greedy, or judge.samples
sampled, each from a stream keyed by what it judges), the parser reads each (rewards/verdicts.py)
and a response's verdicts combine into its score. A verdict the parser cannot read scores
judge.unparsed_score and is counted; a judge prompt over judge.max_prompt_length is not judged
(the same score, counted apart).

    judge/score         the mean combined score          judge/unparsed    verdicts not read (count)
    judge/too_long      responses not judged (count)     judge/verdict_tokens  tokens per verdict
    judge/failures      parser function calls that raised or timed out (count; judge/timeouts of them)
    time/judge_s        the phase's seconds (onload, generation, offload, parsing)
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Tuple, Union

import torch

from megatron_rlhf.config.schema import RLHFConfig
from megatron_rlhf.data.tokenizer import Tokenizer
from megatron_rlhf.generation import SamplingParams, generate, stream_seeds
from megatron_rlhf.memory import KV_CACHE
from megatron_rlhf.rewards.contract import absolute_spec
from megatron_rlhf.rewards.pool import RewardPool
from megatron_rlhf.rewards.verdicts import combined, fill_template, parser_of
from megatron_rlhf.roles.role_set import RoleSet
from megatron_rlhf.roles.rows import SampleRows
from megatron_rlhf.rollout.scoring import pool_scores, scores_here
from megatron_rlhf.runtime.platform import get_platform

JUDGE_STREAMS = 0x4A554447  # keys the judge's sampling streams apart from the policy's ("JUDG")


def read_template(config: RLHFConfig) -> Union[str, List[Dict[str, str]]]:
    """The judge's template: judge.template, the text of judge.template_file (checked at start-up),
    or judge.messages."""
    judge = config.judge
    if judge.template_file is None:
        return judge.template if judge.template is not None else judge.messages
    with open(config.path_of("judge.template_file"), encoding="utf-8") as f:
        return f.read()


def judge_prompt(template: Union[str, List[Dict[str, str]]], prompt: str, response: str, reference: str):
    """The template filled: text, or chat messages each with its content filled."""
    if isinstance(template, str):
        return fill_template(template, prompt, response, reference)
    return [{**m, "content": fill_template(m["content"], prompt, response, reference)} for m in template]


def reference_of(fields: Dict, key: str) -> str:
    """A row's reference (its ``key`` column) as text; empty where the row has none."""
    value = fields.get(key)
    return "" if value is None else str(value)


class Judge:
    """Scores of responses by the judge role (``scores``); built once per run."""

    def __init__(self, config: RLHFConfig, roles: RoleSet, tokenizer: Tokenizer):
        judge = config.judge
        self.config, self.roles, self.tokenizer = config, roles, tokenizer
        self.template, self.parse = read_template(config), parser_of(judge)
        self.sampling = SamplingParams(max_new_tokens=judge.max_new_tokens, greedy=judge.samples == 1,
                                       temperature=judge.temperature, eos_ids=tuple(tokenizer.eos_ids),
                                       pad_id=tokenizer.pad_id)
        self.calls = (0, 0)  # (iteration, judge calls in it): a round's verdicts draw from streams of their own
        self.pool = None  # a parser function's workers, on the ranks that score (scoring.scores_here)
        if judge.parser == "function" and scores_here():
            spec = absolute_spec(judge.parser_function, config.base_dir_of("judge.parser_function"))
            self.pool = RewardPool({spec: 1.0}, num_workers=config.reward.num_workers,
                                   timeout_s=config.reward.timeout_s, failure_score=judge.unparsed_score, wait=False,
                                   not_applicable_score=float("nan"))  # a verdict it returns None for is unparsed

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def prompts(self, prompts: List[str], responses: List[str], fields: List[Dict]) -> List[List[int]]:
        """Each response's judge prompt, encoded."""
        key, chat = self.config.judge.reference_key, self.config.data.apply_chat_template
        return [self.tokenizer.encode_prompt(judge_prompt(self.template, p, r, reference_of(f, key)), chat=chat)
                for p, r, f in zip(prompts, responses, fields)]

    def scores(self, prompts: List[str], responses: List[str], fields: List[Dict], iteration: int
               ) -> Tuple[torch.Tensor, Dict[str, float]]:
        """[B] the judge's score of each of this rank's responses (in the run's cut), and its metrics."""
        judge = self.config.judge
        started = time.perf_counter()
        encoded = self.prompts(prompts, responses, fields)
        judged = [len(ids) <= judge.max_prompt_length for ids in encoded]
        verdicts, lengths = self._verdicts(encoded, judged, iteration)
        counted = [i for i in range(len(verdicts)) if judged[i // judge.samples]]  # a response too long is not judged
        parsed, metrics = self._parsed(verdicts, counted, prompts, responses, fields)
        scores = combined(parsed, judge.samples, judge.combine, judge.unparsed_score)
        metrics.update({"judge/score": sum(scores) / max(len(scores), 1),
                        "judge/unparsed": float(sum(parsed[i] is None for i in counted)),
                        "judge/too_long": float(judged.count(False)),
                        "judge/verdict_tokens": sum(lengths[i] for i in counted) / max(len(counted), 1),
                        "time/judge_s": time.perf_counter() - started})
        return torch.tensor(scores, dtype=torch.float32), metrics

    def _parsed(self, verdicts: List[str], counted: List[int], prompts: List[str], responses: List[str],
                fields: List[Dict]) -> Tuple[List[Optional[float]], Dict[str, float]]:
        """Each verdict's score (None: unparsed, or not judged) by the parser, or by the parser
        function in the reward pool (its failures counted: judge/failures, judge/timeouts)."""
        parsed: List[Optional[float]] = [None] * len(verdicts)
        if self.config.judge.parser != "function":
            for i in counted:
                parsed[i] = self.parse(verdicts[i])
            return parsed, {}
        k = self.config.judge.samples
        rows = [dict(fields[i // k], judged_response=responses[i // k]) for i in counted]
        scores, pooled = pool_scores(self.pool, [prompts[i // k] for i in counted], [verdicts[i] for i in counted], rows)
        for i, score in zip(counted, scores.tolist()):
            parsed[i] = None if math.isnan(score) else score
        return parsed, {"judge/failures": pooled["reward/failures"], "judge/timeouts": pooled["reward/timeouts"]}

    def _verdicts(self, encoded: List[List[int]], judged: List[bool], iteration: int) -> Tuple[List[str], List[int]]:
        """judge.samples verdicts per response (adjacent) and their tokens, generated by the judge
        role at its own layout; a response not judged is fed one token and its verdict dropped
        (every rank keeps its share of rows: a layout of the judge's own recuts equal shares)."""
        judge, cut = self.config.judge, self.roles.cut
        k = judge.samples
        self.calls = (iteration, self.calls[1] + 1) if self.calls[0] == iteration else (iteration, 1)
        fed = [ids if fits else ids[:1] for ids, fits in zip(encoded, judged)]
        rows = [ids for ids in fed for _ in range(k)]
        lengths = torch.tensor([len(ids) for ids in rows])
        tokens = torch.full((len(rows), int(lengths.max())), self.tokenizer.pad_id, dtype=torch.long)
        for row, ids in enumerate(rows):
            tokens[row, : len(ids)] = torch.tensor(ids)
        first = cut.rank * len(encoded)  # this rank's first response of the round, counted over the run's ranks
        response = torch.arange(len(encoded)).repeat_interleave(k) + first
        seeds = stream_seeds(self.config.seed, JUDGE_STREAMS, iteration, self.calls[1], response,
                             torch.arange(k).repeat(len(encoded)))
        device = get_platform().device
        columns = {"tokens": tokens.to(device), "prompt_lengths": lengths.to(device), "seeds": seeds.to(device)}
        out = self.roles.at_layout("judge", self._generate, columns)
        written = out["response_lengths"].tolist()
        texts = [self.tokenizer.decode(t[n : n + r].tolist())
                 for t, n, r in zip(out["tokens"].cpu(), out["prompt_lengths"].tolist(), written)]
        return texts, written

    def _generate(self, mine: SampleRows) -> SampleRows:
        """The (onloaded) judge's verdicts to ``mine``'s prompts, its KV cache in the ledger."""
        judge, role = self.config.judge, self.roles["judge"]
        with self.roles.resident("judge", "inference"):
            gen = generate(role.model, mine["tokens"], mine["prompt_lengths"], self.sampling,
                           self.tokenizer.vocab_size, mine["seeds"],
                           batch_size=self.config.generation.slots(len(mine["tokens"])),
                           cache_length=judge.max_prompt_length + judge.max_new_tokens,
                           on_cache=lambda cache: role.memory.holding(KV_CACHE, [cache.storage], "judge"))
        return {"tokens": gen.tokens, "prompt_lengths": gen.prompt_lengths, "response_lengths": gen.response_lengths}
