"""Multi-turn rollouts through the real engine on 2 processes: (1) the tiny GRPO demo with an
environment that never answers gives the single-turn run's iteration; (2) the agent demo's game
(examples/tiny_agent, TP=2) gives the same rollout and update with EMS off, at micro-batch 1, with the
policy at its own layout, in lockstep, and in 2 slots with replies late by trajectory;
(3) an environment that fails every trajectory of one DP rank, then of both; (4) the tiny
GRPO run with the sandboxed Python tool (tags format) instead of an environment. Saves per rank each
run's metrics, the rollout (gathered over DP) of the game runs, and the error of the last."""

import os

from common import OUT_DIR, one_iteration, save, setup
from tests.helpers.agent_configs import TOOLS_CONFIG
from tests.workers.findings import GameRun, MultiTurn as MultiTurnFindings

from megatron_rlhf.rollout.multiturn import EnvironmentFailure
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args

ENVIRONMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "environments_for_tests.py")
SILENT = ENVIRONMENTS + ":Silent"


def iteration(config_file: str, tp: int, name: str, environment=None, ems: bool = True, micro_batch_size=None,
              policy_tp: str = "", slots=None, correction=None, **rollout):
    os.environ.update(TP=str(tp), ITERATIONS="1", POLICY_TP=policy_tp)
    prepared = prepare(parse_args(["--config", config_file, "--output-dir", os.path.join(OUT_DIR, name)]),
                       int(os.environ["WORLD_SIZE"]))
    config = prepared.config
    for role in config.model_roles:
        config.role(role).free_memory = ems
        if micro_batch_size is not None:
            config.role(role).micro_batch_size = micro_batch_size
    spec = environment or prepared.environment
    if slots is not None:
        config.generation.batch_size = slots
    if correction is not None:
        config.algorithm.rollout_correction.mode = correction
    for key, value in rollout.items():
        setattr(config.rollout, key, value)
    setup(tp=tp, seed=config.seed)
    metrics, controller, r = one_iteration(prepared, spec)
    cut = controller.role_set.cut
    fields = {"tokens": r.tokens, "mask": r.action_mask, "scores": r.scores, "advantages": r.advantages}
    if r.behaviour_log_probs is not None:
        fields.update(behaviour=r.behaviour_log_probs, old=r.old_log_probs)
    rows = cut.gather(fields, prepared.tokenizer.pad_id)
    return GameRun(metrics=metrics, rollout={k: v.cpu() for k, v in rows.items()})



result = MultiTurnFindings.to_fill()
result.single = iteration("examples/tiny/grpo.yaml", 1, "single").metrics
result.silent = iteration("examples/tiny/grpo.yaml", 1, "silent", environment=SILENT, max_turns=1).metrics
result.fails_on_rank_1 = iteration("examples/tiny/grpo.yaml", 1, "fails_on_rank_1",
                                   environment=ENVIRONMENTS + ":RaisesOnRankOne", max_turns=1).metrics
try:
    iteration("examples/tiny/grpo.yaml", 1, "fails_everywhere", environment=ENVIRONMENTS + ":RaisesAlways", max_turns=1)
except EnvironmentFailure as e:  # on every rank: none waits for the others in a collective
    result.fails_everywhere = (str(e), e.collective)
# The sandboxed Python tool in the tags format, wired through the config, the prompts and the workers.
tools_config = os.path.join(OUT_DIR, f"tools_{os.environ['RANK']}.yaml")  # one per rank: no rank reads another's half-written file
with open(tools_config, "w") as f:
    f.write(TOOLS_CONFIG.format(repo=os.getcwd()))
result.tools = iteration(tools_config, 1, "tools").metrics
result.game = iteration("examples/tiny_agent/grpo.yaml", 2, "game")
result.game_ems_off = iteration("examples/tiny_agent/grpo.yaml", 2, "game_ems_off", ems=False)
result.game_mbs1 = iteration("examples/tiny_agent/grpo.yaml", 2, "game_mbs1", micro_batch_size=1)
result.game_policy_tp1 = iteration("examples/tiny_agent/grpo.yaml", 2, "game_policy_tp1", policy_tp="1")
# The schedule of turns: in lockstep; and without it in 2 slots, replies late by 0-60 ms by trajectory.
result.game_lockstep = iteration("examples/tiny_agent/grpo.yaml", 2, "game_lockstep", overlap_turns=False)
# Rollout correction: the engine's log-prob of every model token recorded across the turns.
result.game_correction = iteration("examples/tiny_agent/grpo.yaml", 2, "game_correction", correction="truncate")
result.game_2_slots_late_replies = iteration("examples/tiny_agent/grpo.yaml", 2, "game_2_slots_late_replies", slots=2,
                                             environment=ENVIRONMENTS + ":SlowEchoGame")
save(result)
