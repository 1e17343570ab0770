import os

import pytest

from megatron_rlhf.config import load_config
from megatron_rlhf.memory import planner
from megatron_rlhf.units import human
from tests.conftest import REPO


def test_planned_state_bytes_equal_the_ledger_under_several_layouts(workers):
    checked = experts_checked = 0
    ranks = workers(4, "planner_state")
    # Resharding's buffers (weight sync into a role of its own layout): receive-only exactly as planned;
    # with copies of sent slices the plan is the most loaded rank's (within 0.2% of it), none above it.
    for layouts in ((2, 1, 1), (1, 2, 2)):
        syncs = [next(s for s in r.syncs if s.layouts == layouts) for r in ranks]
        planned = syncs[0].planned
        assert all(s.recorded <= planned for s in syncs), syncs
        assert max(s.recorded for s in syncs) >= 0.998 * planned, syncs
        if layouts == (2, 1, 1):
            assert all(s.recorded == planned for s in syncs), syncs
    for rank_result in ranks:
        for row in rank_result.roles:
            assert row.idle == {}, (row.layout, row.role)  # EMS left nothing on the device
            for kind, measured in row.measured.items():
                planned = row.planned[kind]
                assert abs(planned - measured) <= 0.01 * max(measured, 1), (row.layout, row.role, kind, planned, measured)
                checked += measured > 0
                if row.layout[2] > 1 or {"own layout", "lora"} & set(row.layout[5]):  # to the byte: experts
                    # over EP ranks, their optimizer over expert DP; roles at layouts of their own; LoRA
                    assert planned == measured, (row.layout, row.role, kind, planned, measured)
                    experts_checked += measured > 0
    assert checked > 50 and experts_checked >= 5 * 4 * 2 + 3 * 4


def _in_rows(config, training: int = 2, inference: int = 4):
    """The tiny demo's roles on micro-batches of fixed rows (the demo packs them by tokens)."""
    for role in config.model_roles:
        rc = config.role(role)
        rc.micro_batch_size, rc.max_tokens_per_micro_batch = (training if role.startswith("ppo_") else inference), None
    return config


def test_peak_phase_and_recommendation_for_a_budget(monkeypatch):
    for key in ("TP", "PP"):
        monkeypatch.delenv(key, raising=False)
    for role in ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value"):
        monkeypatch.setenv(f"free_memory_{role}", "False")
    config = _in_rows(load_config(os.path.join("examples", "tiny", "rlhf.yaml"), world_size=2))
    everything = planner.plan(config, 2)
    # Without EMS every phase holds every role's state, plus its active role's transient memory.
    state = sum(sum(kinds.values()) for kinds in everything.roles.values())
    assert all(total >= state for total in everything.phases.values())
    switches, fitted = planner.recommend(config, 2, budget=int(everything.peak_bytes * 0.7))
    assert switches is not None and fitted.peak_bytes <= everything.peak_bytes * 0.7
    assert any(s.kinds() for s in switches.values())
    impossible, best = planner.recommend(config, 2, budget=1000)
    assert impossible is None and best.peak_bytes > 1000


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 1), (2, 1, 4), (1, 2, 2)])
def test_kv_cache_and_weight_formulas(tp, pp, dp):
    from megatron_rlhf.config.schema import ModelArchConfig

    arch = ModelArchConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                           ffn_hidden_size=128, vocab_size=100, max_position_embeddings=256)
    assert planner.kv_cache_bytes(arch, 3, 10, tp, pp, "bf16") == 2 * (4 // pp) * 3 * 10 * (2 // tp) * 16 * 2
    # Every rank's share: TP-split matrices once over the TP ranks, norms on each TP rank.
    shares = sum(sum(planner.param_numels(arch, "lm", tp, pp, r)) for r in range(pp)) * tp
    norms = (4 * 2 + 1) * 64
    matrices = arch.padded_vocab_size(tp) * 64 * 2 + 4 * ((4 + 2 * 2) * 16 * 64 + 64 * 64 + 2 * 128 * 64 + 64 * 128)
    assert shares == matrices + norms * tp


def test_plan_command_prints_the_table_and_answers_a_budget():
    import subprocess
    import sys

    def plan(*args):
        env = {k: v for k, v in os.environ.items() if k not in ("TP", "PP") and not k.startswith("free_memory_")}
        return subprocess.run([sys.executable, "-m", "megatron_rlhf.plan", "--config", "examples/tiny/rlhf.yaml", *args],
                              capture_output=True, text=True, env=env)

    fits = plan("--gpu-memory", "8MiB")  # the demo's micro-batches hold 32 rows of 48 tokens for inference
    assert fits.returncode == 0 and "<- peak" in fits.stdout and "fits in 8.00 MiB" in fits.stdout
    assert "ppo_policy" in fits.stdout and "kv_cache" in fits.stdout
    too_small = plan("--gpu-memory", "100KiB")
    assert too_small.returncode == 1 and "does not fit in 100.00 KiB" in too_small.stdout and "over" in too_small.stdout
    bad = plan("--gpu-memory", "lots")
    assert bad.returncode == 2 and "expected a size such as 80GiB" in bad.stderr


def test_pipeline_training_keeps_up_to_pp_micro_batches_of_activations(monkeypatch):
    """1F1B: the first stage runs PP forwards before its first backward."""
    monkeypatch.setenv("TP", "1")
    monkeypatch.setenv("PP", "2")
    config = _in_rows(load_config(os.path.join("examples", "tiny", "rlhf.yaml"), world_size=2))
    p = planner.plan(config, 2)
    rc = config.ppo_policy
    one = planner.activation_bytes(rc.model, "lm", rc.micro_batch_size, p.layout["seq"], 1, 2, rc.precision,
                                   rc.recompute_activations, True, logprob_chunk_tokens=rc.logprob_chunk_tokens)
    assert p.transient["ppo_policy"]["activations"] == 2 * one  # 4 micro-batches per step, PP=2 in flight
    inference = planner.activation_bytes(config.reference.model, "lm", config.reference.micro_batch_size,
                                         p.layout["seq"], 1, 2, "fp32", False, False, logprob_chunk_tokens=1024)
    assert p.transient["reference"]["activations"] == inference


def test_a_critic_free_plan_has_no_value_roles_and_counts_every_response(monkeypatch):
    for key in ("TP", "PP", "SAMPLES_PER_PROMPT", "ROLLOUT_BATCH_SIZE"):
        monkeypatch.delenv(key, raising=False)
    config = load_config(os.path.join("examples", "tiny", "grpo.yaml"), world_size=2)
    plan = planner.plan(config, 2)
    assert set(plan.roles) == {"policy", "reference", "ppo_policy"}  # the reward is a rule function
    assert list(plan.phases) == ["generate", "reference", "train_policy"]
    # The KV cache holds 8 prompts x 4 responses, as generation decodes them, and the scratch slot.
    arch, seq = config.policy.model, plan.layout["seq"]
    assert plan.transient["policy"]["kv_cache"] == planner.kv_cache_bytes(arch, 33, seq, 2, 1, config.policy.precision)
    # The decode step's working memory (on CUDA the graphs' pool) for the same 33 rows, in the generate phase only.
    step = plan.transient["policy"]["decode_step"]
    vocab = config.padded_vocab(arch) // 2
    assert step == planner.decode_step_bytes(arch, 33, seq, 2, 1, config.policy.precision, config.padded_vocab(arch))
    assert step > 33 * vocab * (4 + 4 + 12 + 4)  # the sampling's fp32 tensors over the vocabulary, and the forward
    assert plan.resident["generate"]["policy"]["decode_step"] == step
    assert all("decode_step" not in plan.resident[phase].get("policy", {}) for phase in ("reference", "train_policy"))


def test_generation_batch_size_auto_takes_the_most_rows_whose_plan_fits(monkeypatch):
    """generation.batch_size: auto (memory/auto.decode_slots): the most rows decoded at once whose
    planned peak fits the budget (one more does not), every row where all fit, none where one does
    not; the dry run says the choice for --gpu-memory."""
    import subprocess
    import sys

    from megatron_rlhf.memory.auto import decode_slots

    for key in ("TP", "PP", "SAMPLES_PER_PROMPT", "ROLLOUT_BATCH_SIZE"):
        monkeypatch.delenv(key, raising=False)
    overrides = ["generation.batch_size=auto", "generation.max_new_tokens=192", "ppo.rollout_batch_size=32"]
    config = load_config(os.path.join("examples", "tiny", "grpo.yaml"), world_size=2, overrides=overrides)

    def peak(slots):
        config.generation.batch_size = slots
        return planner.plan(config, 2).peak_bytes

    rows = 128  # 32 prompts x 4 responses, all on the one DP rank of TP=2
    peaks = {s: peak(s) for s in (1, 100, 101, rows)}
    config.generation.batch_size = "auto"
    assert peaks[101] > peaks[100] > peaks[1]  # past 86 rows the cache makes the peak: it grows with the slots
    assert decode_slots(config, 2, peaks[100])[:2] == (100, rows)
    assert decode_slots(config, 2, peaks[101] - 1)[0] == 100
    assert decode_slots(config, 2, 10 * peaks[rows])[0] == rows
    assert decode_slots(config, 2, peaks[1] - 1)[0] == 0
    assert config.generation.batch_size == "auto"  # the search leaves the config as it was
    out = subprocess.run([sys.executable, "-m", "megatron_rlhf.train", "--config", os.path.join("examples", "tiny", "grpo.yaml"),
                          "--dry-run", "--world-size", "2", "--gpu-memory", str(peaks[100]), *overrides], capture_output=True,
                         text=True, cwd=REPO, env={k: v for k, v in os.environ.items() if k not in ("TP", "PP")})
    assert "generation.batch_size: auto: in " in out.stdout and ", 100 of 128 rows decoded at once per DP rank" in out.stdout, \
        out.stdout[-2000:] + out.stderr[-2000:]
    # The phases and the verdict are those of the 100 rows chosen (they were of all 128: "does not fit").
    assert f"fits in {human(peaks[100])} with peak {human(peaks[100])} (generate)" in out.stdout, out.stdout[-2000:]


def test_when_no_row_can_be_decoded_the_phase_that_does_not_fit_is_named(monkeypatch):
    """Not the KV cache is blamed where another phase (here the reference's log-probs) does not fit
    whatever the engine decodes; where generation itself is what does not fit, the cache is."""
    from megatron_rlhf.memory.auto import decode_slots, no_row_fits

    for key in ("TP", "PP", "SAMPLES_PER_PROMPT", "ROLLOUT_BATCH_SIZE"):
        monkeypatch.delenv(key, raising=False)
    config = load_config(os.path.join("examples", "tiny", "grpo.yaml"), world_size=2,
                         overrides=["generation.batch_size=auto", "reference.logprob_chunk_tokens=0"])
    config.generation.batch_size = 1
    one_row = planner.plan(config, 2)
    config.generation.batch_size = "auto"
    assert one_row.peak_phase == "reference" and one_row.phases["generate"] < one_row.peak_bytes
    slots, _, fitted = decode_slots(config, 2, one_row.phases["generate"])
    said = no_row_fits(fitted, one_row.phases["generate"])
    assert slots == 0 and said.startswith("the reference phase peaks at ") and "and the generation phase fits" in said
    slots, _, fitted = decode_slots(config, 2, one_row.phases["generate"] - 1)
    assert slots == 0 and no_row_fits(fitted, one_row.phases["generate"] - 1).startswith("not one row's KV cache fits")


@pytest.mark.parametrize("size", ["7b", "13b", "70b"])
def test_free_memory_auto_chooses_what_the_plan_command_recommends(size, monkeypatch):
    """The start-up choice (memory/auto.py, every role on auto) against the recommendation of the
    dry run's memory report (`python -m megatron_rlhf.plan --gpu-memory`), for the Llama-2 presets
    of run_ppo.sh at 80 and 40 GiB."""
    import re

    from megatron_rlhf.config import ROLE_NAMES, load_config
    from megatron_rlhf.dry_run import memory_report
    from megatron_rlhf.launch import resolve_environment
    from megatron_rlhf.memory.auto import choose_free_memory

    config_file = REPO / "examples/llama2/rlhf.yaml"
    env = {"MODEL_SIZE": size}
    assert resolve_environment(env, str(config_file.parent), str(REPO)) == []
    world = int(env["NNODES"]) * int(env["GPUS_PER_NODE"])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    configured = load_config(str(config_file), world_size=world, check_inputs=False)
    for role in ROLE_NAMES:
        monkeypatch.setenv(f"free_memory_{role}", "auto")
    auto = load_config(str(config_file), world_size=world, check_inputs=False)
    assert all(auto.role(r).free_memory == "auto" for r in auto.model_roles)
    for gib in (80, 40):
        text, fits = memory_report(configured, world, gib * 2**30)
        switches, _ = choose_free_memory(auto, world, gib * 2**30)
        assert (switches is not None) == fits, (size, gib)
        if fits:
            listed = re.search(r"when these leave the device while idle: (.*)", text).group(1)
            chosen = "; ".join(f"{r}: {', '.join(s.kinds())}" for r, s in switches.items() if s.kinds()) or "nothing"
            assert chosen == listed, (size, gib)


def test_the_plan_command_takes_the_launchers_model_size(capsys, launch_environment, monkeypatch):
    from megatron_rlhf import plan as plan_command

    # The recipe's default, free_memory: auto: the fewest switches that fit the GPU.
    assert plan_command.main(["--config", "examples/llama2/rlhf.yaml", "--model-size", "70b", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "TP=8 PP=2 DP=2" in out  # Llama-2-70B on 4 x 8 GPUs, as launched
    assert "fits in 80.00 GiB with peak 76.17 GiB (train_policy) when these leave the device while idle: reference: " \
           "weights; reward: weights; ppo_policy: main_params, optimizer_state; ppo_value: main_params, optimizer_state" in out
    for role in ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value"):
        monkeypatch.setenv(f"free_memory_{role}", "True")  # every switch on
    assert plan_command.main(["--config", "examples/llama2/rlhf.yaml", "--model-size", "70b"]) == 0
    assert "52.07 GiB  <- peak" in capsys.readouterr().out
    assert plan_command.main(["--config", "examples/llama2/rlhf.yaml", "--model-size", "65b"]) == 2
    assert "MODEL_SIZE=65b: expected one of tiny, 7b" in capsys.readouterr().err
