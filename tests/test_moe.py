"""Mixtures of experts (Qwen3-MoE, Mixtral) on megatron-core's MoE layers: converted from tiny
random transformers models, they give transformers' logits and greedy generate() at TP=2, PP=2
and EP=2, convert back to the same tensors, and every field or layout we do not model is refused by
name."""

import json
import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_rlhf.config.families import arch_from_hf_config  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.helpers.hf_families import assert_outputs_match, assert_round_trip, converted_for_equivalence, greedy_cases  # noqa: E402

# Qwen3-MoE with renormalised top-2 and a dense first layer; Mixtral (every layer experts); Qwen3-MoE
# without renormalisation (softmax before the top-3) and experts every second layer, as a reward model;
# Qwen2-MoE (q/k/v biases, a gated shared expert beside the routed ones, a dense last layer).
CASES = [("qwen3_moe", "lm"), ("mixtral", "lm"), ("qwen3_moe-unnormed", "scalar"), ("qwen2_moe", "lm")]
LAYOUTS = {"tp2_pp1": "2.1.1", "tp1_pp2": "1.2.1", "tp1_pp1_ep2": "1.1.2"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    models, ranks = converted_for_equivalence(root, CASES, "--layouts=" + ",".join(LAYOUTS.values()))
    return root, models, ranks


def test_the_converted_models_have_the_families_routing(converted):
    root, _, _ = converted
    meta = {name: json.loads((root / name / "mg" / "megatron_rlhf_model.json").read_text())["arch"] for name, _ in CASES}
    assert [meta["qwen3_moe"][k] for k in ("num_experts", "moe_router_topk", "moe_norm_topk_prob", "moe_dense_layers")] \
        == [4, 2, True, [0]]
    assert [meta["qwen3_moe-unnormed"][k] for k in ("moe_router_topk", "moe_norm_topk_prob", "moe_layer_step")] == [3, False, 2]
    assert [meta["mixtral"][k] for k in ("num_experts", "moe_ffn_hidden_size", "moe_norm_topk_prob")] == [4, 48, True]
    assert [meta["qwen2_moe"][k] for k in ("qkv_bias", "moe_shared_expert_ffn_hidden_size", "moe_norm_topk_prob",
                                           "moe_dense_layers")] == [True, 48, False, [1]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_equal_transformers_at_tp2_pp2_and_ep2(converted, layout):
    _, models, ranks = converted
    assert_outputs_match(models, ranks, layout, 1 if layout == "tp1_pp2" else 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_generation_equals_transformers_row_by_row(converted, layout):
    _, models, ranks = converted
    for name, _, _, expected in greedy_cases(models, ranks):
        for r in ranks:
            assert r.generated[(name, layout)] == expected, name
        if layout == "tp1_pp1_ep2":  # rank 1 had 2 rows, rank 0 all 8: each still got transformers' rows
            unequal = [r.generated_unequal[(name, layout)] for r in ranks]
            assert [len(rows) for rows in unequal] == [8, 2]
            for rows in unequal:
                assert rows == expected[: len(rows)]


def test_each_moe_family_converts_back_to_the_same_tensors_and_model(converted):
    assert_round_trip(*converted)


QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                 vocab_size=100, num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2, norm_topk_prob=True)
MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=48, num_attention_heads=4, num_hidden_layers=2,
               vocab_size=100, num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("config,message", [
    ({**MIXTRAL, "router_jitter_noise": 0.1}, r"router_jitter_noise: 0.1 is not supported \(supported: 0.0, 0\): noise"),
    ({k: v for k, v in QWEN3_MOE.items() if k != "num_experts_per_tok"}, r"missing num_experts_per_tok"),
    ({k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}, r"missing num_experts\|num_local_experts"),
    ({**QWEN3_MOE, "model_type": "qwen3"}, r"num_experts: not a field of the qwen3 family"),
    ({**QWEN3_MOE, "shared_expert_intermediate_size": 64}, r"shared_expert_intermediate_size: not a field of the qwen3_moe"),
], ids=["jitter", "no-topk", "no-experts", "dense-family", "shared-expert"])
def test_moe_fields_we_do_not_model_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(config, "config.json")


def test_qwen3_moe_sparse_step_and_dense_layers_give_the_layer_pattern():
    arch = arch_from_hf_config({**QWEN3_MOE, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, "c")
    assert arch.moe_layers() == [0, 1, 0, 0, 0, 1]  # (i + 1) % 2 == 0, layer 3 dense
    transformers5 = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert arch_from_hf_config(transformers5, "c").num_experts == 4  # the name transformers 5 writes


def _load(tmp_path, model_yaml, parallel="", world_size=2, ppo_policy=""):
    from megatron_rlhf.config import load_config

    base = os.path.join(os.path.dirname(__file__), "..", "examples", "tiny", "grpo.yaml")
    (tmp_path / "moe.yaml").write_text(f"includes: {os.path.abspath(base)}\n{parallel}\n"
                                       + "".join(f"{r}:\n  model: {model_yaml}\n" for r in ("policy", "reference", "ppo_policy"))
                                       + ppo_policy)
    return load_config(str(tmp_path / "moe.yaml"), world_size=world_size, check_inputs=False)


MOE_YAML = "{preset: tiny, family: qwen3_moe, num_experts: 4, moe_ffn_hidden_size: 32}"


@pytest.mark.parametrize("model,parallel,world,message", [
    (MOE_YAML, "parallel: {tensor_model_parallel_size: 1, expert_model_parallel_size: 3}", 6,
     r"expert_model_parallel_size: 3 does not divide policy, reference, ppo_policy's num_experts=4"),
    (MOE_YAML, "parallel: {tensor_model_parallel_size: 1, expert_model_parallel_size: 4}", 2,
     r"expert_model_parallel_size: 4 does not divide the data-parallel size 2 .*valid EP: 1, 2"),
    (MOE_YAML, "parallel: {tensor_model_parallel_size: 2}", 2,
     r"tensor_model_parallel_size: 2, but ppo_policy trains a model with experts"),
    ("{preset: tiny}", "parallel: {expert_model_parallel_size: 2}", 2,
     r"expert_model_parallel_size: 2, but no role's model has experts"),
    ("{preset: tiny, family: qwen3_moe}", "parallel: {tensor_model_parallel_size: 1}", 2, r"num_experts: family 'qwen3_moe' is a mixture of experts"),
    ("{preset: tiny, num_experts: 4}", "", 2, r"num_experts: family 'llama' has no experts"),
    ("{preset: tiny, moe_z_loss_coeff: 0.001, moe_shared_expert_ffn_hidden_size: 32}", "", 2,
     r"moe_z_loss_coeff, moe_shared_expert_ffn_hidden_size: set for a model without experts"),
    ("{preset: tiny, family: qwen2_moe, num_experts: 4, moe_ffn_hidden_size: 32}", "parallel: {tensor_model_parallel_size: 1}", 2,
     r"moe_shared_expert_ffn_hidden_size: family 'qwen2_moe' has a shared expert"),
    ("{preset: tiny, family: qwen3_moe, num_experts: 4, moe_ffn_hidden_size: 32, moe_shared_expert_ffn_hidden_size: 32}",
     "parallel: {tensor_model_parallel_size: 1}", 2, r"moe_shared_expert_ffn_hidden_size"),
    ("{preset: tiny, family: qwen3_moe, num_experts: 4, moe_ffn_hidden_size: 32, moe_router_topk: 5, moe_dense_layers: [7]}",
     "parallel: {tensor_model_parallel_size: 1}", 2, r"(?s)moe\.yaml: policy\.model\.moe_router_topk: 5 is more than num_experts=4.*moe_dense_layers: \[7\] are not layers"),
])
def test_moe_layouts_and_features_that_cannot_run_are_refused_by_name(tmp_path, model, parallel, world, message):
    from megatron_rlhf.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, model, parallel, world)


@pytest.fixture(scope="module")
def moe_updates(tmp_path_factory):
    from tests.conftest import run_workers

    tmp = tmp_path_factory.mktemp("moe_invariance")
    return run_workers(tmp, 1, "moe_invariance", "single")[0], run_workers(tmp, 2, "moe_invariance", "layouts")


def relative_difference(got, expected):
    assert sorted(got) == sorted(expected)  # every expert's gradient, gathered from the EP rank holding it
    return max(((got[k] - expected[k]).abs().max() / expected[k].abs().max().clamp(min=1e-30)).item() for k in expected)


def test_without_the_load_balancing_loss_the_update_does_not_depend_on_the_cut(moe_updates):
    single, layouts = moe_updates
    uncut = single.steps[(0.0, "mb8")]
    assert uncut.moe == {}  # nothing switched on, nothing reported
    cuts = [single.steps[(0.0, "mb1")], single.steps[(0.0, "mb4")]] + [r.steps[(0.0, name)] for r in layouts
                                                                       for name in ("dp2", "ep2", "pp2")]
    for cut in cuts:
        assert relative_difference(cut.grads, uncut.grads) <= 1e-5
        assert cut.loss == pytest.approx(uncut.loss, rel=1e-5)


def test_the_load_balancing_loss_depends_on_the_micro_batches_but_not_on_where_experts_live(moe_updates):
    """megatron's "aux_loss" is computed per micro-batch from the routing of all of its tokens: what
    it adds to the gradient changes with the micro-batches (measured, documented in the README), never
    with the expert layout: DP=2 and DP=2 x EP=2 cut the same micro-batches and agree."""
    single, layouts = moe_updates
    uncut = single.steps[(0.1, "mb8")]
    assert set(uncut.moe) == {"moe/load_balancing_loss", "moe/z_loss"}
    assert all(v > 0 for v in uncut.moe.values())
    for r in layouts:
        ep2, dp2 = r.steps[(0.1, "ep2")], r.steps[(0.1, "dp2")]
        assert relative_difference(ep2.grads, dp2.grads) <= 1e-5
        assert ep2.moe == pytest.approx(dp2.moe, rel=1e-5)
    for cut in (single.steps[(0.1, "mb1")], single.steps[(0.1, "mb4")], layouts[0].steps[(0.1, "pp2")]):
        assert relative_difference(cut.grads, uncut.grads) > 1e-3  # the dependence, as documented
        assert cut.loss == pytest.approx(uncut.loss, rel=1e-5)  # the policy loss itself is not affected


@pytest.mark.parametrize("model,setting,message", [
    ("{preset: tiny}", "moe: {routing_replay: rollout}", r"moe\.routing_replay: rollout, but the policy has no experts"),
    (MOE_YAML, "moe: {routing_replay: old_logprob}",
     r"ppo_policy\.recompute_activations: true cannot be used with moe\.routing_replay: old_logprob"),
    (MOE_YAML, "moe: {routing_replay: always}", r"moe\.routing_replay: expected one of 'off', 'rollout', 'old_logprob', got str 'always'"),
])
def test_routing_replay_settings_that_cannot_run_are_refused_by_name(tmp_path, model, setting, message):
    from megatron_rlhf.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, model, "parallel: {tensor_model_parallel_size: 1}\n" + setting,
              ppo_policy="  recompute_activations: true\n" if "old_logprob" in setting else "")


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    from tests.conftest import run_workers

    return run_workers(tmp_path_factory.mktemp("routing_replay"), 2, "routing_replay")


EXPERTS = 4


def _with_experts(ranks):
    """Each rank's result at EP=2 and at PP=2 where its stage has experts (PP=2: the last only),
    after checking that a stage without them records and replays nothing."""
    for rank in ranks:
        assert rank.experts == EXPERTS
        for r in (rank.ep2, rank.pp2):
            if r.layers == 0:
                assert r.record.shape[2] == r.engine.shape[2] == 0
                continue
            yield r


def _experts(routes, experts):
    """[..., K] expert indices (-1: none) -> [..., E] 0/1."""
    hot = torch.zeros(*routes.shape[:-1], experts + 1, dtype=torch.uint8)
    hot.scatter_(-1, routes.long() % (experts + 1), 1)  # -1 lands in the spare last column
    return hot[..., :experts]


def test_generation_records_the_experts_the_old_log_prob_pass_routes_to(replayed):
    """The engine's record (rollout) equals the routing of the full-sequence pass over the same rows
    (fp32, same weights), and holds every fed token: all but each row's last."""
    for r in _with_experts(replayed):
        engine, record, lengths = r.engine, r.record, r.lengths
        fed = torch.arange(engine.shape[1])[None, :] < (lengths - 1)[:, None]
        assert ((engine[..., 0, 0] >= 0) == fed).all()
        assert (engine[fed] == record[fed]).all()
        known = record[..., 0, 0] >= 0
        assert (r.recorded_inference[known] == _experts(record, EXPERTS)[known]).all()  # what the hooks saw


def test_replayed_forwards_route_every_token_to_the_recorded_experts_after_the_router_moved(replayed):
    """After optimizer steps, every later forward (inference and training) with the record replayed
    routes each recorded token to exactly its recorded experts, as the routers' own outputs show;
    without replay the same forwards send many of them elsewhere."""
    for r in _with_experts(replayed):
        record = r.record
        known = record[..., 0, 0] >= 0
        expected = _experts(record, EXPERTS)[known]
        for kind in ("inference", "training"):
            assert (r.routed[("replayed", kind)][known] == expected).all(), kind
            moved = (r.routed[("free", kind)][known] != expected).any(-1).float().mean().item()
            assert moved > 0.1, (kind, moved)


@pytest.fixture(scope="module")
def moe_demo(tmp_path_factory):
    """`make demo-moe` (EP=2) with every role's memory freed between phases and with none, the
    routing recorded by the old-log-prob pass and DAPO's dynamic sampling (rows regathered over DP)."""
    from tests.test_train import FREE_MEMORY_VARS, train

    base = tmp_path_factory.mktemp("moe_demo")
    for ems, iterations in (("True", 25), ("False", 6)):  # 25 of its 40 show it learns; the first 6 compared
        train(base / ems, "--iterations", str(iterations), config="examples/tiny/moe.yaml",
              env={**MOE_DEMO_ENV, **{v: ems for v in FREE_MEMORY_VARS}})
    return base


MOE_DEMO_ENV = {"ROUTING_REPLAY": "old_logprob", "DYNAMIC_SAMPLING": "True"}


def test_the_moe_demo_learns_with_experts_split_and_reports_its_router_losses(moe_demo):
    from tests.test_train import metrics

    rows = metrics(moe_demo / "True")
    first, last = (sum(r["reward/mean"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert len(rows) == 25 and last > first + 0.2, (first, last)
    assert all(r["policy/moe/load_balancing_loss"] > 0 and r["policy/moe/z_loss"] > 0 for r in rows)
    # The first step of each iteration replays the routing the same weights chose: nothing moves yet.
    assert all(0 <= r["policy/moe/replay_moved"] < 1 for r in rows) and any(r["policy/moe/replay_moved"] > 0 for r in rows)
    shard = torch.load(next((moe_demo / "True" / "checkpoints").glob("iter_*/ppo_policy/release/mp_rank_00/*.pt")),
                       weights_only=True)["model"]
    assert sum(".local_experts." in k and k.endswith("linear_fc1.weight") for k in shard) == 4  # both EP ranks' experts


def test_freeing_the_moe_demos_memory_changes_no_number(moe_demo):
    from tests.test_train import metrics, without_times

    assert without_times(metrics(moe_demo / "True")[:6]) == without_times(metrics(moe_demo / "False"))


def test_the_moe_demo_runs_with_a_pipeline_stage_that_has_no_experts(tmp_path):
    """PP=2: the first stage holds only the dense first layer, yet takes part in every reduction of
    the router losses and of routing replay (a stage that skipped them would hang its peer)."""
    from tests.test_train import metrics, train

    train(tmp_path, "--iterations", "2", config="examples/tiny/moe.yaml", env={"PP": "2", "EP": "1"},
          timeout=180)  # the demo's routing replay: recorded by generation
    for r in metrics(tmp_path):
        assert r["policy/moe/load_balancing_loss"] > 0 and r["policy/moe/z_loss"] > 0
        assert 0 <= r["policy/moe/replay_moved"] < 1


def test_a_resumed_moe_run_continues_exactly_as_an_uninterrupted_one_and_at_another_expert_layout(tmp_path, moe_demo):
    import shutil

    from tests.test_train import metrics, train, without_times

    moe = {"config": "examples/tiny/moe.yaml", "env": MOE_DEMO_ENV}
    train(tmp_path / "split", "--iterations", "2", **moe)
    for name in ("ep2", "ep1"):
        shutil.copytree(tmp_path / "split", tmp_path / name)
    train(tmp_path / "split", "--iterations", "4", "--resume", **moe)
    assert without_times(metrics(tmp_path / "split")) == without_times(metrics(moe_demo / "True")[:4])
    # The EP=2 checkpoint at EP=1: each expert's Adam moments come from the EP rank that held it, and
    # the optimizer chain is rebuilt (at EP=2 the experts have an optimizer of their own, at EP=1 they
    # share the dense one's groups). Against the same checkpoint resumed at EP=2, both with the
    # reference loaded from it (a seeded reference would be another network at another layout).
    reference = tmp_path / "reference"
    shutil.copytree(tmp_path / "ep2" / "checkpoints" / "iter_0000002" / "ppo_policy", reference,
                    ignore=shutil.ignore_patterns("optim"))
    config = tmp_path / "moe.yaml"
    config.write_text(f"includes: {REPO / moe['config']}\nreference:\n  load: {reference}\n")
    for name, ep in (("ep2", "2"), ("ep1", "1")):
        train(tmp_path / name, "--iterations", "4", "--resume", "--allow-config-change", config=config,
              env={**MOE_DEMO_ENV, "EP": ep})
    at_ep2, at_ep1 = (without_times(metrics(tmp_path / name))[2:] for name in ("ep2", "ep1"))
    assert [r["iteration"] for r in at_ep1] == [3, 4] and at_ep1[0]["kl/mean"] == 0.0  # the resumed policy
    for mine, theirs in zip(at_ep1, at_ep2):
        for key, value in theirs.items():
            if not key.startswith("weight_sync/"):
                assert abs(mine[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, mine[key], value)


def test_a_checkpoint_whose_optimizer_is_per_model_parallel_rank_is_refused_at_another_expert_layout(tmp_path, monkeypatch):
    """Not the distributed optimizer: its state is per model-parallel rank, refused at start-up
    naming both layouts and the key that changed."""
    from megatron_rlhf.checkpoint.model_files import CheckpointError
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.startup import prepare
    from megatron_rlhf.train import parse_args
    from tests.test_faults import fake_checkpoint

    monkeypatch.setenv("USE_DISTRIBUTED_OPTIMIZER", "False")
    written = load_config(str(REPO / "examples" / "tiny" / "moe.yaml"), world_size=2)
    out = tmp_path / "out"
    fake_checkpoint(out, "iter_0000001", written, tp=1, dp=2, ep=2)
    monkeypatch.setenv("EP", "1")
    with pytest.raises(CheckpointError) as refused:
        prepare(parse_args(["--config", str(REPO / "examples" / "tiny" / "moe.yaml"), "--output-dir", str(out),
                            "--resume"]), 2)
    said = str(refused.value)
    assert "written at TP=1 PP=1 EP=2; resume with the same TP, PP and EP (its optimizer (not the distributed one) is " \
        "per model-parallel rank)" in said
    assert "parallel.expert_model_parallel_size (environment variable EP=1)" in said  # the key that changed
    assert "tensor_model_parallel_size" not in said


# MODEL_SIZE: (nodes of 8 GPUs, EP) by default; billions of parameters in all and active per token
# (the published 30.5B / 3.3B, 46.7B / 12.9B, 235B / 22B).
MOE_PRESETS = {"qwen3-30b-a3b": (1, 8, 30.53, 3.35), "mixtral-8x7b": (2, 8, 46.70, 12.88),
               "qwen3-235b-a22b": (16, 32, 235.09, 22.19)}


@pytest.mark.parametrize("size", sorted(MOE_PRESETS))
def test_each_moe_preset_is_transformers_model_and_plans_to_fit_its_launch_default(size, tmp_path, monkeypatch, capsys,
                                                                                     launch_environment):
    """The preset's config.json, built by transformers on the meta device, has the parameters the dry
    run counts; the launcher's default layout for it fits 80 GiB GPUs."""
    from megatron_rlhf import launch
    from megatron_rlhf.config.families import hf_config_from_arch

    nodes, ep, billions, active = MOE_PRESETS[size]
    arch = _load(tmp_path, f"{{preset: {size}}}", "parallel: {tensor_model_parallel_size: 1}", 1).policy.model
    config = transformers.AutoConfig.for_model(**hf_config_from_arch(arch, "lm", "bfloat16"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions

    launch_environment.update(DRY_RUN="1", MODEL_SIZE=size)
    monkeypatch.setattr(os, "execv", None)  # a dry run never launches
    assert launch.main(["--config", os.path.join("examples", "llama2", "grpo.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"{nodes * 8} processes = {nodes} node(s) x 8; TP=1" in out and f" EP={ep} for every role" in out
    assert re.search(rf"ppo_policy +{re.escape(size)} +{billions:.2f}B +lm", out), out
    assert f"({active:.2f}B parameters active)" in out
    assert "expert-parallel groups:" in out
    assert re.search(r"^fits in 80\.00 GiB", out, re.M), out
