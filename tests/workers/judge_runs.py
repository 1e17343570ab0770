"""GRPO scored by an LLM judge alone (examples/tiny_judge/grpo.yaml, 2 ranks, TP=1 DP=2, fp32), two
iterations through the run's entry: with every role off the device while idle, with none, and with
the judge at a layout of its own (TP=2), and with judge prompts over 20 tokens not judged. Each judges with two sampled verdicts per response.
Args: JUDGE_LOAD (a converted judge checkpoint)."""

import os

import torch
from common import ARGS, OUT_DIR, REWARDS_FOR_TESTS, computed_metrics, one_iteration, save, setup
from tests.workers.findings import JudgeRuns

from megatron_rlhf.controller import PPOController
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.memory.planner import plan
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args

SETTINGS = ["judge.model.preset=auto", "ppo.rollout_batch_size=4", "judge.samples=2", "judge.temperature=1.0",
            "judge.combine=mean", "trainer.tensorboard=false"]
EMS_OFF = [f"{role}.free_memory=false" for role in ("policy", "reference", "ppo_policy", "judge")]
RUNS = {"ems_on": [], "ems_off": EMS_OFF, "judge_tp2": ["judge.parallel.tensor_model_parallel_size=2"],
        "short_prompts": ["judge.max_prompt_length=20"]}

os.environ.update(JUDGE_LOAD=ARGS[0], ITERATIONS="2", PROGRESS_BAR="False")
result = JudgeRuns.to_fill()
result.metrics, result.scores = {}, {}
for name, overrides in RUNS.items():
    prepared = prepare(parse_args(["--config", "examples/tiny_judge/grpo.yaml", "--output-dir",
                                   os.path.join(OUT_DIR, name), *SETTINGS, *overrides]), 2)
    setup(tp=1, seed=prepared.config.seed)
    ledger = MemoryLedger(None)
    controller = PPOController(prepared.config, prepared.dataset, prepared.tokenizer, None, ledger)
    scored = controller.collector.scorer.score
    last = {}

    def spy(*args):
        scores, metrics = scored(*args)
        last["scores"] = controller.role_set.cut.gather_tensor(scores).cpu()
        return scores, metrics

    controller.collector.scorer.score = spy
    result.metrics[name] = [computed_metrics(controller.step()) for _ in range(1 if name == "short_prompts" else 2)]
    result.scores[name] = last["scores"]
    if name == "ems_on":
        result.records = ledger.records
        result.planned = plan(prepared.config, 2).resident
    controller.close()
# The parser as a function in the reward pool's workers against the number parser: the same scores
JUDGED = ["reward.type=judge", "reward.function=null",
          "judge.enabled=true", f"judge.load={ARGS[0]}", "judge.model.preset=auto", "judge.template=r {response} s",
          "judge.max_new_tokens=3", "judge.max_prompt_length=64", "ppo.rollout_batch_size=4",
          "parallel.tensor_model_parallel_size=1", "trainer.tensorboard=false",
          "data.tokenizer.alphabet=abcdefghijklmnopqrstuvwxyz 0123456789"]
PARSERS = {"parser_number": ["judge.parser=number", "judge.score_range=[0, 9]"],
           "parser_function": ["judge.parser=function", f"judge.parser_function={REWARDS_FOR_TESTS}:first_number"]}
os.environ.pop("ITERATIONS")
for name, parser in PARSERS.items():
    prepared = prepare(parse_args(["--config", "examples/tiny/grpo.yaml", "--iterations", "1", "--output-dir",
                                   os.path.join(OUT_DIR, name), *JUDGED, *parser]), 2)
    setup(tp=1, seed=prepared.config.seed)
    metrics, controller, rollout = one_iteration(prepared)
    controller.close()
    result.metrics[name], result.scores[name] = [computed_metrics(metrics)], rollout.scores.cpu()

# A process reward model (seeded) in REINFORCE++: each step's score a reward at its last token
prepared = prepare(parse_args(["--config", "examples/tiny/grpo.yaml", "--output-dir", os.path.join(OUT_DIR, "prm"),
                               "--iterations", "1", "reward.type=model", "reward.function=null",
                               "reward.step_separator=a", "reward.step_aggregation=token", "reward.free_memory=true",
                               "algorithm.advantage_estimator=reinforce_plus_plus", "ppo.rollout_batch_size=4",
                               "parallel.tensor_model_parallel_size=1", "trainer.tensorboard=false"]), 2)
setup(tp=1, seed=prepared.config.seed)
metrics, _, rollout = one_iteration(prepared)
result.process_reward = {"metrics": computed_metrics(metrics), "tokens": rollout.tokens.cpu(),
                         "prompt_lengths": rollout.prompt_lengths.cpu(), "response_lengths": rollout.response_lengths.cpu(),
                         "scores": rollout.scores.cpu(), "step_rewards": rollout.step_rewards.cpu()}
save(result)
