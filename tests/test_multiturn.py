"""Multi-turn rollouts without a model: trajectories token in and token out against chat templates
applied once, the loss mask in the RL math, and the environment pool's failures (rollout/)."""

import contextlib
import textwrap
import types

import pytest
import torch

from megatron_rlhf import ppo
from megatron_rlhf.data.tokenizer import CharTokenizer, HFTokenizer
from megatron_rlhf.rollout.env_pool import EnvironmentPool
from megatron_rlhf.agents.protocol import ProtocolError, StepResult, checked_step
from megatron_rlhf.rollout.trajectory import ObservationEncoder, Trajectory
from tests.helpers.hf_tokenizer import byte_level_tokenizer_dir, make_tokenizer_dir

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def llama3_tokenizer_dir(path):
    """A BPE tokenizer with Llama-3's special tokens and a Llama-3-style chat template."""
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]
    corpus = "user assistant tool what is two plus two the answer is four call the calculator result 4"
    return byte_level_tokenizer_dir(path, specials, "<|eot_id|>", LLAMA3_TEMPLATE, corpus, bos="<|begin_of_text|>",
                                    vocab_size=300)


# Within the tiny ChatML tokenizer's alphabet (it has no unknown token), no reply merging with the
# generation prompt before it (a template applied once could tokenise across that boundary).
CONVERSATION = [
    ("user", "what is 2 + 2 ?"),
    ("assistant", "answer with 4"),
    ("user", "4 + 0 = 4"),
    ("assistant", "answer 4"),
    ("user", "be brief"),
    ("assistant", "with 4"),
]


@pytest.fixture(params=["chatml", "llama3"])
def chat_tokenizer(request, tmp_path):
    if request.param == "chatml":
        return HFTokenizer(str(make_tokenizer_dir(tmp_path / "chatml")))
    return HFTokenizer(str(llama3_tokenizer_dir(tmp_path / "llama3")))


def _template_ids(tokenizer, conversation):
    once = tokenizer._tok.apply_chat_template([{"role": r, "content": c} for r, c in conversation], tokenize=True)
    return list(once["input_ids"] if hasattr(once, "keys") else once)


def _scripted_trajectory(tokenizer, conversation, once):
    """The trajectory a scripted policy makes: the prompt, each assistant turn as the model emits it
    (the ids of the conversation's reply, through its end token), each other message through the
    encoder. Returns it and every earlier state of its buffer."""
    encoder = ObservationEncoder(tokenizer, chat=True)
    trajectory = Trajectory(tokenizer.encode_prompt([{"role": conversation[0][0], "content": conversation[0][1]}], True), 1)
    last_turn, snapshots = [], []
    for role, content in conversation[1:]:
        snapshots.append(list(trajectory.tokens))
        if role == "assistant":
            start = len(trajectory.tokens)
            end = next(i for i in range(start, len(once)) if once[i] in tokenizer.eos_ids) + 1
            last_turn = once[start:end]
            assert tokenizer.decode(last_turn).strip() == content  # the policy says what the conversation says
            trajectory.append_model(last_turn)
        else:
            trajectory.append_observation(encoder.encode([{"role": role, "content": content}], last_turn, tokenizer.eos_ids))
    return trajectory, snapshots


def test_a_trajectory_is_the_template_applied_once_with_the_loss_mask_on_the_model_tokens(chat_tokenizer):
    tok = chat_tokenizer
    once = _template_ids(tok, CONVERSATION)
    trajectory, snapshots = _scripted_trajectory(tok, CONVERSATION, once)
    assert trajectory.tokens == once[: len(trajectory.tokens)]
    # What the template writes after the last assistant turn's end token is only its boundary.
    assert tok.decode(once[len(trajectory.tokens):]).strip() == ""
    # Append-only: every earlier state is a prefix of the final buffer.
    assert all(trajectory.tokens[: len(s)] == s for s in snapshots)
    # The loss mask is 1 exactly on the model's tokens: each assistant turn's content and end token.
    masked_text = [tok.decode([t]) for t, m in zip(trajectory.tokens, trajectory.mask) if m]
    assert "".join(masked_text).replace(" ", "") == "".join(c for r, c in CONVERSATION if r == "assistant").replace(" ", "")
    assert sum(t in tok.eos_ids for t, m in zip(trajectory.tokens, trajectory.mask) if m) == 3 == trajectory.turns
    assert not any(m for t, m in zip(trajectory.tokens, trajectory.mask) if tok.decode([t]).strip() == "user")


def test_a_turn_cut_before_its_end_token_gets_the_templates_closing(chat_tokenizer):
    tok = chat_tokenizer
    encoder = ObservationEncoder(tok, chat=True)
    turn = tok.encode_text("answer")  # stopped at the per-turn limit: no end token
    ids = encoder.encode("2 + 2", turn, tok.eos_ids)
    assert ids[0] == tok.eos_ids[0]  # the template's end of the assistant turn comes first
    text = tok._tok.decode(ids)
    assert "2 + 2" in text and text.rstrip().endswith(tok._tok.decode(tok.encode_prompt([{"role": "user", "content": "x"}], True)[-3:]).rstrip())


def test_without_a_template_an_observation_is_its_text():
    tok = CharTokenizer("abc >")
    encoder = ObservationEncoder(tok, chat=False)
    assert encoder.encode(" a>", [3], tok.eos_ids) == tok.encode(" a>")
    assert encoder.encode(None, [3], tok.eos_ids) == []


def test_a_long_observation_loses_its_middle():
    t = Trajectory([1, 2], 1)
    t.append_observation(t.fitted_observation(list(range(10, 30)), limit=6))
    assert t.tokens == [1, 2, 10, 11, 12, 27, 28, 29] and t.mask == [0] * 8 and t.truncated_observations == 1


# -- the loss mask in the RL math ----------------------------------------------------------------

def test_the_policy_loss_of_a_multi_turn_batch_counts_model_tokens_only():
    torch.manual_seed(0)
    # Two trajectories: model tokens, then environment tokens, then model tokens again (mask 1 0 1).
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 0, 0, 0, 1, 1]], dtype=torch.float32)
    logp = torch.randn(2, 8, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(2, 8)
    adv = torch.randn(2, 8)
    per_token, _ = ppo.policy_loss_terms(logp, old, adv, 0.2, 0.2)
    loss_sum, count = ppo.aggregate_loss(per_token, mask, "token-mean")
    (loss_sum / count).backward()
    # The direct formula over the model's tokens only.
    ratio = torch.exp(logp.detach() - old)
    direct = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert torch.allclose(loss_sum / count, direct[mask.bool()].mean(), atol=1e-6)
    assert (logp.grad[mask == 0] == 0).all() and (logp.grad[mask == 1] != 0).any()


def test_kl_rewards_and_gae_ignore_the_environments_tokens():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]], dtype=torch.float32)
    kl = ppo.kl_penalty(torch.randn(1, 6), torch.randn(1, 6), "k1") * mask
    rewards = ppo.token_rewards(torch.tensor([2.0]), kl, 0.1, mask)
    assert (rewards[mask == 0] == 0).all()
    assert rewards[0, 4] == pytest.approx(2.0 - 0.1 * kl[0, 4].item())  # the score on the last model token
    values = torch.randn(1, 6)
    adv, returns = ppo.gae_advantages(rewards, values, mask, 1.0, 0.95)
    assert (adv[mask == 0] == 0).all()
    # Model tokens see each other across the environment's reply as consecutive steps.
    model = mask[0].bool()
    compact_adv, _ = ppo.gae_advantages(rewards[:, model], values[:, model], torch.ones(1, 3), 1.0, 0.95)
    assert torch.allclose(adv[:, model], compact_adv, atol=1e-6)


# -- the environment pool --------------------------------------------------------------------------

ENVIRONMENTS = textwrap.dedent('''
    import os, time

    class Counter:
        """Replies with its count; the prompt says how it misbehaves at step 2."""
        def start(self, row):
            self.mode, self.n = row["prompt"], 0
            return "start"
        def step(self, turn):
            self.n += 1
            if self.n == 2:
                if self.mode == "raise":
                    raise RuntimeError("the game broke")
                if self.mode == "hang":
                    time.sleep(60)
                if self.mode == "exit":
                    os._exit(3)
                if self.mode == "non-text":
                    return 42, False, None, {}
            return f"count {self.n}", self.n >= 3, 1.0, {}
''')


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "envs.py"
    path.write_text(ENVIRONMENTS)
    pool = EnvironmentPool(f"{path}:Counter", num_workers=2, timeout_s=2.0)
    yield pool
    pool.close()


def test_every_failure_is_its_trajectorys_own_and_named(pool):
    modes = ["ok", "raise", "hang", "exit", "non-text", "ok", "ok", "ok"]
    ids = list(range(100, 100 + len(modes)))  # trajectories 2k live in worker 0, 2k+1 in worker 1
    starts = pool.call([(i, "start", {"prompt": m}) for i, m in zip(ids, modes)])
    assert starts == [("ok", "start")] * len(modes)
    turn = {"text": "x", "token_ids": [1], "index": 0, "ended": True}
    first = pool.call([(i, "step", turn) for i in ids])
    assert all(kind == "ok" and r.observation == "count 1" for kind, r in first)
    second = dict(zip(modes, pool.call([(i, "step", turn) for i in ids])))
    assert second["raise"][0] == "raised" and "RuntimeError: the game broke" in second["raise"][1]
    assert second["hang"][0] == "timeout" and "env_timeout_s" in second["hang"][1]
    assert second["exit"][0] == "exited" and "exit code 3" in second["exit"][1]
    assert second["non-text"][0] == "protocol" and "int 42" in second["non-text"][1]
    # The healthy trajectories that shared a worker with the hang or the exit were rebuilt by
    # replay and go on from where they were.
    healthy = [i for i, m in zip(ids, modes) if m == "ok"]
    third = pool.call([(i, "step", turn) for i in healthy])
    assert all(kind == "ok" and r.observation == "count 3" and r.done for kind, r in third)
    pool.release(ids)


def test_a_rebuilt_environment_that_answers_otherwise_fails_its_trajectory():
    """A trajectory resumed in another iteration has its environment rebuilt by making its calls
    again; each answer must be what the first answered (an environment that draws at random, or
    whose code changed since, would put the model's next turns against a board it never saw)."""
    from megatron_rlhf.rollout.multiturn import MultiTurn

    def resumed():
        t = Trajectory([1, 2], index=0)
        t.calls = [("start", {"prompt": "p"}), ("step", {"text": "a"})]
        t.answers = [[[5, 6], False, None], [[7], False, 0.5]]
        return Trajectory.from_state(t.state(), 0, version=1)

    same, other = resumed(), resumed()
    for t in (same, other):
        t.replaying = 2
    counts = {"rollout/env_replayed_calls": 0, "rollout/env_failures": 0, "rollout/env_timeouts": 0}
    assert MultiTurn._replayed(None, same, ([5, 6], False, None, None, {}), counts) is None  # more to come
    assert MultiTurn._replayed(None, same, ([7], False, 0.5, None, {}), counts) is True and same.failure is None
    assert MultiTurn._replayed(None, other, ([5, 6], False, None, None, {}), counts) is None
    assert MultiTurn._replayed(None, other, ([7, 8], False, 0.5, None, {}), counts) is False
    assert "call 2 (step) answered otherwise than when it was first made" in other.failure
    assert counts == {"rollout/env_replayed_calls": 4, "rollout/env_failures": 1, "rollout/env_timeouts": 0}


def test_the_step_protocol_is_checked():
    assert checked_step(("hi", False, 1, {})) == StepResult("hi", False, 1.0, {})
    for bad, words in [((None, "yes", None, {}), "done="), ((None, True, float("nan"), {}), "reward="),
                       ([{"role": "robot", "content": "x"}], "message"), ((None, True), "tuple of 2")]:
        with pytest.raises(ProtocolError, match=words):
            checked_step(bad if isinstance(bad, tuple) else (bad, False, None, {}))


def test_reinforce_returns_run_across_the_environments_tokens():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([[0.5, 0.0, 0.0, 0.0, 2.0, 0.0]])
    returns = ppo.discounted_returns(rewards, mask, 0.9)
    assert torch.allclose(returns, torch.tensor([[0.5 + 0.81 * 2.0, 0.9 * 2.0, 0, 0, 2.0, 0]]))


# -- through the engine, on 2 processes ------------------------------------------------------------

def _numbers(metrics):
    """The metrics a rollout's numbers decide: not times, nor how the work was scheduled."""
    from megatron_rlhf.rollout.record import SCHEDULE_METRICS

    return {k: v for k, v in metrics.items() if not k.startswith("time/") and k not in SCHEDULE_METRICS}


def test_multi_turn_rollouts_through_the_engine(tmp_path):
    from tests.conftest import run_workers

    ranks = run_workers(tmp_path, 2, "multiturn", timeout=400)
    r = ranks[0]
    # An environment that never answers: the single-turn run's iteration, figure for figure.
    single, silent = _numbers(r.single), _numbers(r.silent)
    assert {k: silent[k] for k in single} == single
    assert silent["rollout/turns_mean"] == 1 and silent["rollout/env_failures"] == 0
    assert silent["rollout/env_calls"] == 2 * 32  # a start and a step per trajectory, over both DP ranks
    # The tool environment through the config and the workers: every tool metric reported (a random
    # tiny model writes no call: every trajectory answers at its first turn).
    tools = r.tools
    assert tools["rollout/env_calls"] == 2 * 64 and tools["rollout/env_failures"] == 0  # a start and a step each
    assert tools["rollout/turns_mean"] == 1 and tools["rollout/tool_calls"] == tools["rollout/tool_errors"] == 0
    assert "rollout/tool_timeouts" in tools and "time/tool_s" in tools
    # One DP rank's trajectories all fail: counted, the run goes on; every trajectory fails: both
    # ranks end with the error naming the environment (decided together).
    assert r.fails_on_rank_1["rollout/env_failures"] == 16 and r.fails_on_rank_1["rollout/env_calls"] == 64
    for rank in ranks:
        message, collective = rank.fails_everywhere
        assert collective and "environments_for_tests.py:RaisesAlways: every trajectory of the batch failed" in message
        assert "the game is broken" in message or "another rank" in message
    # The game: the same rollout and update with EMS off, at micro-batch 1 and with the policy at its own layout.
    base = r.game
    assert base.metrics["rollout/turns_mean"] == 4 and base.metrics["rollout/env_failures"] == 0
    assert base.metrics["rollout/prefix_recomputed"] == 0  # every trajectory kept its cache across turns
    mask, tokens = base.rollout["mask"], base.rollout["tokens"]
    assert 0 < base.metrics["rollout/model_token_share"] < 1 and mask.sum() < (tokens[:, 1:] > 0).sum()
    width = int((tokens != 0).sum(dim=1).max())  # the pad id is 0: each run's rows padded to its widest
    # The same with the policy generating at a layout of its own (TP=1 x DP=2 while the run is TP=2).
    # Rollout correction across turns: the engine's log-prob of each model token is the policy's
    # (the same weights), 0 at the replies' tokens; the tokens are the game's.
    corrected = r.game_correction.rollout
    model_tokens = corrected["mask"] > 0
    assert torch.equal(corrected["tokens"][:, :width], tokens[:, :width])
    assert (corrected["behaviour"][model_tokens] - corrected["old"][model_tokens]).abs().max() < 1e-4
    assert corrected["behaviour"][model_tokens].lt(0).all() and not corrected["behaviour"][~model_tokens].any()
    # ... and whatever the schedule of turns: in lockstep, or in 2 slots with replies late by trajectory.
    assert r.game_2_slots_late_replies.metrics["rollout/prefix_recomputed"] > 0  # slots were taken over
    for name, other in (("EMS off", r.game_ems_off), ("micro-batch 1", r.game_mbs1), ("policy TP=1", r.game_policy_tp1),
                        ("lockstep", r.game_lockstep), ("2 slots, late replies", r.game_2_slots_late_replies)):
        assert torch.equal(other.rollout["tokens"][:, :width], tokens[:, :width])
        assert torch.equal(other.rollout["mask"][:, : width - 1], mask[:, : width - 1])
        assert torch.allclose(other.rollout["advantages"][:, : width - 1], base.rollout["advantages"][:, : width - 1], atol=1e-5)
        for key, value in _numbers(base.metrics).items():
            if key == "rollout/prefix_recomputed" and other is r.game_2_slots_late_replies:
                continue  # fewer slots: caches taken over, prefixes fed again (the tokens the same)
            if not (key.startswith("weight_sync/") and other is r.game_policy_tp1):  # its weights are resharded
                assert other.metrics[key] == pytest.approx(value, abs=1e-5), (name, key)


# -- the turn loop with a scripted engine ------------------------------------------------------

class _Group:
    def rank(self):
        return 0

    def size(self):
        return 1


class _ScriptedRun:
    """Stands in for the engine's open run: a trajectory's k-th turn is ``turns[k]`` (the last one
    again after) cut to its limit, ended at the next step; a row whose key kept its slot resumes
    (``slots`` slots, the latest keys)."""

    def __init__(self, turns, slots):
        self.turns, self.slots = list(turns), slots
        self.rows, self.holders, self.served = [], [], {}
        self.peers, self.stats = None, types.SimpleNamespace(sampled=0, slot_steps=1)

    @property
    def busy(self):
        return bool(self.rows)

    def add(self, keys, prompts, limits, seeds):
        resumed = sum(key in self.holders for key in keys)
        for key, limit in zip(keys, limits):
            if key not in self.holders:
                self.holders = (self.holders + [key])[-self.slots:]
            k = self.served.get(key, 0)
            self.served[key] = k + 1
            self.rows.append((key, self.turns[min(k, len(self.turns) - 1)][:limit]))
        return resumed

    def release(self, key):
        pass

    def step(self, active=True):
        if not active:
            return None
        ended, self.rows = self.rows, []
        return [(key, list(ids), None) for key, ids in ended]


class _ScriptedCollector:
    """Stands in for the collector: one replica of one rank."""

    def __init__(self, turns, slots):
        model = types.SimpleNamespace(pg_collection=types.SimpleNamespace(tp=_Group(), pp=_Group()))
        self.roles = {"policy": types.SimpleNamespace(model=model)}
        self.turns, self.slots = turns, slots

    def open_run(self, rows, params, record_log_probs=False):
        return contextlib.nullcontext(_ScriptedRun(self.turns, self.slots))


def _turns(tmp_path, environment: str, slots=2, **rollout):
    from megatron_rlhf.config.schema import RLHFConfig
    from megatron_rlhf.generation import SamplingParams
    from megatron_rlhf.rollout.multiturn import MultiTurn

    (tmp_path / "envs.py").write_text(textwrap.dedent(environment))
    config = RLHFConfig()
    for key, value in {"env_timeout_s": 5.0, **rollout}.items():
        setattr(config.rollout, key, value)
    tok = CharTokenizer("abc >")
    turns = MultiTurn(config, tok, f"{tmp_path / 'envs.py'}:Env", chat=False)
    prompts = types.SimpleNamespace(texts=["b", "c"], fields=[{}, {}])
    mine = {"tokens": torch.tensor([[1, 4], [1, 5]]), "prompt_lengths": torch.tensor([2, 2]),
            "seeds": torch.tensor([7, 8]), "prompt_index": torch.tensor([0, 1])}
    params = SamplingParams(max_new_tokens=2, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    try:
        # Every turn: "a" then the end token.
        return turns.run(_ScriptedCollector([tok.encode("a") + [tok.eos_id]], slots), mine, prompts.texts, prompts.fields,
                         params), tok
    finally:
        turns.close()


def test_turns_alternate_with_replies_and_the_limits_end_them(tmp_path):
    (rows, metrics), tok = _turns(tmp_path, """
        class Env:
            def start(self, row):
                return " >"
            def step(self, turn):
                return "bbbbbb", False, 0.5, {}
    """, max_turns=3, max_observation_tokens=4)
    # prompt, reply " >", then per turn "a" + end token, the reply cut to 4 ("bb" + "bb"), after the
    # last turn no reply: the trajectory ends with the model's tokens.
    one = [1, 4] + tok.encode(" >") + (tok.encode("a") + [2] + tok.encode("bbbb")) * 2 + tok.encode("a") + [2]
    assert rows["tokens"][0].tolist() == one
    assert rows["action_mask"][0].tolist() == [float(t in (2, tok.encode("a")[0]) and i > 3) for i, t in enumerate(one)][1:]
    assert rows["turn_rewards"].tolist() == [1.5, 1.5]
    assert metrics["rollout/turns_mean"] == 3 and metrics["rollout/truncated_observations"] == 4
    assert metrics["rollout/env_calls"] == 2 + 3 * 2 and metrics["rollout/prefix_recomputed"] == 0


def test_a_trajectory_that_lost_its_cache_slot_is_counted_and_the_context_ends_a_turn(tmp_path):
    (rows, metrics), tok = _turns(tmp_path, """
        class Env:
            def start(self, row):
                return " >"
            def step(self, turn):
                return "b", False, None, {}
    """, slots=1, max_turns=3, max_trajectory_tokens=8, overlap_turns=False)
    # In lockstep, so that who loses the slot does not depend on when each reply came (without it,
    # a quick reply lets the first trajectory take its slot back before the second starts).
    # 4 prompt tokens, "a" + end, "b", then room for one token only: "a" (the turn's limit), the
    # context is full and the trajectory ends.
    assert rows["tokens"][0].tolist() == [1, 4] + tok.encode(" >") + tok.encode("a") + [2] + tok.encode("b") + tok.encode("a")
    assert rows["response_lengths"].tolist() == [6, 6] and metrics["rollout/context_truncated"] == 2
    assert metrics["rollout/prefix_recomputed"] == 1  # one slot for two trajectories: the second lost it


def test_a_trajectory_whose_environment_fails_ends_alone_and_every_failure_ends_the_batch(tmp_path):
    from megatron_rlhf.rollout.multiturn import EnvironmentFailure

    (rows, metrics), _ = _turns(tmp_path, """
        class Env:
            def start(self, row):
                self.prompt = row["prompt"]
            def step(self, turn):
                if self.prompt == "b":
                    raise KeyError("no such move")
                return "c", False, None, {}
    """, max_turns=2)
    assert metrics["rollout/env_failures"] == 1 and metrics["rollout/env_timeouts"] == 0
    assert rows["response_lengths"].tolist() == [2, 2 + 1 + 2]  # one turn, then failed; two turns around a reply
    with pytest.raises(EnvironmentFailure, match=r"environment .*envs.py:Env: every trajectory of the batch failed; "
                                                 r"the first step: raised KeyError: 'no such move'"):
        _turns(tmp_path, """
            class Env:
                def start(self, row):
                    return None
                def step(self, turn):
                    raise KeyError("no such move")
        """)


def test_a_stop_string_of_several_tokens_cuts_the_turn_right_after_it_once():
    from megatron_rlhf.config.schema import RLHFConfig
    from megatron_rlhf.rollout.multiturn import MultiTurn

    config = RLHFConfig()
    config.rollout.stop = ["</python>", ">"]
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz<>/()+ 0123456789")
    turns = MultiTurn(config, tok, "unused:Env", chat=False)
    assert turns.stop_ids == (tok.encode(">")[0],) and turns.stop_strings == ("</python>",)
    ids = tok.encode("run <python>print(1)</python> then </python> more")
    cut = turns._cut_at_stop(ids)
    assert tok.decode(cut) == "run <python>print(1)</python>"  # at the first closing tag, its tokens once
    assert turns._cut_at_stop(tok.encode("no tag here")) == tok.encode("no tag here")


def test_dapos_overlong_penalty_counts_a_trajectorys_model_tokens_against_its_turns():
    from megatron_rlhf.config.schema import RLHFConfig
    from megatron_rlhf.rollout.scoring import overlong_penalty

    config = RLHFConfig()
    config.rollout.environment = "env.py:Game"
    config.rollout.max_turns, config.rollout.max_tokens_per_turn = 3, 4  # 12 model tokens at most
    config.algorithm.overlong_buffer_length, config.algorithm.overlong_penalty_factor = 4, 1.0
    assert config.model_token_budget == 12
    # Three trajectories of 20 response positions: 6, 9 and 12 model tokens among the replies' tokens.
    mask = torch.zeros(3, 20)
    for row, (model, at) in enumerate([(6, [0, 1, 2, 8, 9, 10]), (9, list(range(0, 9))), (12, list(range(0, 20, 2))[:10] + [11, 13])]):
        mask[row, at] = 1
        assert mask[row].sum() == model
    rows = {"action_mask": mask, "response_lengths": torch.tensor([20, 20, 20])}
    # Soft limit 12 - 4 = 8: 6 tokens free, 9 lose 1/4, 12 lose all (the replies' tokens never count).
    assert overlong_penalty(config, rows).tolist() == [0.0, -0.25, -1.0]
    config.rollout.environment = None  # single-turn: the response's length against max_new_tokens
    config.generation.max_new_tokens = 24
    assert overlong_penalty(config, {"response_lengths": torch.tensor([20, 24])}).tolist() == [0.0, -1.0]
