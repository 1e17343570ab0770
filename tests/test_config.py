import os
import re
import textwrap
from pathlib import Path

import pytest

from megatron_rlhf.config import ConfigError, load_config, load_tree
from megatron_rlhf.config.loader import interpolate
from tests.conftest import REPO

ROLES = ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def tiny_setup(tmp_path: Path, top_extra: str = "", model_extra: str = "") -> Path:
    write(tmp_path / "models" / "tiny.yaml", "model:\n  preset: tiny\n" + textwrap.dedent(model_extra))
    roles = "".join(f"{r}:\n  model_config_file: models/tiny.yaml\n" for r in ROLES)
    return write(tmp_path / "rlhf.yaml", roles + textwrap.dedent(top_extra))


# --- ${ENV:default} ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "env, expected",
    [(None, True), ("False", False), ("false", False), ("TRUE", True), ("7", 7), ("0.5", 0.5),
     ("1e-6", 1e-6), ("/data/x", "/data/x")],
)
def test_interpolation_types_the_value_and_env_wins(monkeypatch, env, expected):
    monkeypatch.delenv("MRLHF_X", raising=False)
    if env is not None:
        monkeypatch.setenv("MRLHF_X", env)
    value = interpolate("${MRLHF_X:True}", "f.yaml", ("a",))
    assert value == expected and type(value) is type(expected)


def test_interpolation_inside_text_and_missing_variable(monkeypatch):
    monkeypatch.setenv("MRLHF_ROOT", "/scratch")
    monkeypatch.delenv("MRLHF_UNSET", raising=False)
    assert interpolate("${MRLHF_ROOT:/tmp}/run-${MRLHF_UNSET:1}", "f.yaml", ("a",)) == "/scratch/run-1"
    with pytest.raises(ConfigError, match=r"f\.yaml: a\.b: environment variable MRLHF_UNSET is not set"):
        interpolate("${MRLHF_UNSET}", "f.yaml", ("a", "b"))


def test_env_var_reaches_the_typed_config(tmp_path, monkeypatch):
    top = tiny_setup(tmp_path, "seed: ${MRLHF_SEED:5}\n")
    text = top.read_text().replace(
        "policy:\n  model_config_file: models/tiny.yaml\n",
        "policy:\n  model_config_file: models/tiny.yaml\n  free_memory: ${free_memory_policy:True}\n",
    )
    top.write_text(text)
    monkeypatch.delenv("free_memory_policy", raising=False)
    monkeypatch.delenv("MRLHF_SEED", raising=False)
    config = load_config(str(top))
    assert config.policy.free_memory is True and config.seed == 5
    monkeypatch.setenv("free_memory_policy", "False")
    monkeypatch.setenv("MRLHF_SEED", "11")
    config = load_config(str(top))
    assert config.policy.free_memory is False and config.seed == 11


# --- includes and model files -----------------------------------------------------------------

def test_includes_are_relative_merged_in_order_and_overridden(tmp_path):
    write(tmp_path / "base" / "a.yaml", "x: 1\nnested: {p: 1, q: 1}\n")
    write(tmp_path / "base" / "b.yaml", "includes: a.yaml\nnested: {q: 2}\ny: b\n")
    top = write(tmp_path / "top.yaml", "includes: [base/b.yaml]\nnested: {r: 3}\ny: top\n")
    tree, sources = load_tree(str(top))
    assert tree == {"x": 1, "nested": {"p": 1, "q": 2, "r": 3}, "y": "top"}
    assert sources[("nested", "q")].endswith("base/b.yaml")
    assert sources[("nested", "p")].endswith("base/a.yaml")
    assert sources[("y",)].endswith("top.yaml")


def test_include_cycle_and_missing_include_are_errors(tmp_path):
    write(tmp_path / "a.yaml", "includes: b.yaml\n")
    write(tmp_path / "b.yaml", "includes: a.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_tree(str(tmp_path / "a.yaml"))
    write(tmp_path / "c.yaml", "includes: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such config file \(named by .*c\.yaml: includes\)"):
        load_tree(str(tmp_path / "c.yaml"))


def test_role_model_file_is_the_base_and_the_role_entry_wins(tmp_path):
    top = tiny_setup(tmp_path, model_extra="precision: fp32\nmicro_batch_size: 4\n")
    text = top.read_text().replace(
        "ppo_policy:\n  model_config_file: models/tiny.yaml\n",
        "ppo_policy:\n  model_config_file: models/tiny.yaml\n  micro_batch_size: 2\n",
    )
    top.write_text(text)
    config = load_config(str(top))
    assert config.policy.precision == "fp32" and config.policy.micro_batch_size == 4
    assert config.ppo_policy.micro_batch_size == 2
    assert config.policy.model.num_layers == 2 and config.policy.model.hidden_size == 64
    assert config.source_of("policy.precision").endswith("models/tiny.yaml")
    assert config.source_of("ppo_policy.micro_batch_size").endswith("rlhf.yaml")


# --- errors that name file, key and what is valid ---------------------------------------------

def test_unknown_key_names_file_key_and_suggests(tmp_path):
    top = tiny_setup(tmp_path, model_extra="free_memroy: true\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(top))
    message = str(err.value)
    assert "models/tiny.yaml: policy.free_memroy: unknown key" in message
    assert "did you mean 'free_memory'" in message


def test_wrong_type_names_file_and_expected_type(tmp_path):
    top = tiny_setup(tmp_path, model_extra="micro_batch_size: two\n")
    with pytest.raises(ConfigError, match=r"tiny\.yaml: policy\.micro_batch_size: expected int or one of 'auto', got str 'two'"):
        load_config(str(top))
    top = tiny_setup(tmp_path, model_extra="precision: fp8\n")
    with pytest.raises(ConfigError, match=r"precision: expected one of 'fp32', 'bf16'"):
        load_config(str(top))


def test_only_true_and_false_are_booleans_so_off_reads_as_written(tmp_path):
    """YAML 1.1 reads on/off/yes/no as booleans; here they stay words, as from the environment."""
    top = tiny_setup(tmp_path, model_extra="free_memory: yes\n")
    with pytest.raises(ConfigError, match=r"policy\.free_memory: expected .*got str 'yes'"):
        load_config(str(top))
    top = tiny_setup(tmp_path, model_extra="free_memory: True\n")
    assert load_config(str(top)).policy.free_memory is True
    (tmp_path / "off.yaml").write_text(f"includes: {top}\nmoe: {{routing_replay: off}}\n")
    assert load_config(str(tmp_path / "off.yaml")).moe.routing_replay == "off"


def test_unknown_preset_lists_valid_ones(tmp_path):
    top = tiny_setup(tmp_path)
    (tmp_path / "models" / "tiny.yaml").write_text("model:\n  preset: llama9\n")
    with pytest.raises(ConfigError, match=r"unknown preset 'llama9'; valid presets are: tiny, llama2-7b"):
        load_config(str(top))


def test_tp_not_dividing_attention_heads(tmp_path):
    top = tiny_setup(tmp_path, "parallel: {tensor_model_parallel_size: 3}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(top))
    # Once per network, naming every role that uses it.
    assert "rlhf.yaml: parallel.tensor_model_parallel_size: 3 does not divide policy, reference, reward, value, " \
           "ppo_policy, ppo_value's num_attention_heads=4" in str(err.value)
    assert "valid TP: 1, 2, 4" in str(err.value)


def test_tp_not_dividing_gqa_groups(tmp_path):
    top = tiny_setup(tmp_path, "parallel: {tensor_model_parallel_size: 4}\n")
    with pytest.raises(ConfigError, match=r"4 does not divide policy, .*ppo_value's num_query_groups=2 \(grouped-query attention"):
        load_config(str(top))


def test_world_size_not_divisible_by_tp_times_pp(tmp_path):
    top = tiny_setup(tmp_path, "parallel: {tensor_model_parallel_size: 2, pipeline_model_parallel_size: 2}\n")
    load_config(str(top), world_size=8)
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by TP\*PP = 2\*2 = 4"):
        load_config(str(top), world_size=6)


def test_pp_not_dividing_layers(tmp_path):
    top = tiny_setup(tmp_path, "parallel: {pipeline_model_parallel_size: 3}\n")
    with pytest.raises(ConfigError, match=r"3 does not divide policy, .*ppo_value's num_layers=2 .* valid PP: 1, 2"):
        load_config(str(top))


def test_global_batch_must_divide_by_micro_batch_times_dp(tmp_path):
    top = tiny_setup(tmp_path)
    text = top.read_text().replace(
        "ppo_value:\n  model_config_file: models/tiny.yaml\n",
        "ppo_value:\n  model_config_file: models/tiny.yaml\n  micro_batch_size: 2\n  global_batch_size: 6\n",
    )
    top.write_text(text + "ppo: {rollout_batch_size: 24}\n")
    load_config(str(top), world_size=1)
    with pytest.raises(ConfigError, match=r"ppo_value\.global_batch_size: 6 is not divisible by micro_batch_size\*DP = 2\*2 = 4"):
        load_config(str(top), world_size=2)


def test_every_problem_is_reported_at_once(tmp_path):
    top = tiny_setup(tmp_path, "parallel: {tensor_model_parallel_size: 3, pipeline_model_parallel_size: 3}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(top))
    assert "num_attention_heads" in str(err.value) and "num_layers" in str(err.value)


def test_errors_name_the_file_a_role_key_came_from_through_model_file_includes(tmp_path):
    top = tiny_setup(tmp_path)
    write(tmp_path / "models" / "common.yaml", "model:\n  hiden_size: 64\n")
    (tmp_path / "models" / "tiny.yaml").write_text("includes: common.yaml\nmodel:\n  preset: tiny\n")
    with pytest.raises(ConfigError, match=r"models/common\.yaml: policy\.model\.hiden_size: unknown key; did you mean 'hidden_size'"):
        load_config(str(top))


def test_sequence_parallel_is_refused_at_config_time_with_the_reason(tmp_path):
    top = tiny_setup(tmp_path, "parallel: {tensor_model_parallel_size: 2, sequence_parallel: true}\n")
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel: not supported yet: it needs transformer-engine's layers"):
        load_config(str(top), world_size=2)


@pytest.mark.parametrize("sampling", ["top_k: 5", "top_p: 0.9"])
def test_truncated_sampling_is_refused_because_ppo_needs_the_sampled_distribution(tmp_path, sampling):
    top = tiny_setup(tmp_path, f"generation: {{{sampling}}}\n")
    with pytest.raises(ConfigError, match=r"PPO's ratios need the log-probs of the distribution the rollout sampled from"):
        load_config(str(top), world_size=1)


def test_loss_agg_mode_accepts_the_three_modes_only(tmp_path):
    assert load_config(str(tiny_setup(tmp_path, "ppo: {loss_agg_mode: seq-mean-token-mean}\n")), world_size=1).ppo.loss_agg_mode == "seq-mean-token-mean"
    with pytest.raises(ConfigError, match=r"ppo\.loss_agg_mode: expected one of 'token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean'"):
        load_config(str(tiny_setup(tmp_path, "ppo: {loss_agg_mode: sum}\n")), world_size=1)


def test_a_serving_role_switch_that_moves_its_owners_shared_weights_is_noted(tmp_path):
    from megatron_rlhf.config.validation import weight_sharing_notes

    top = tiny_setup(tmp_path)
    text = top.read_text().replace("policy:\n  model_config_file: models/tiny.yaml\n",
                                   "policy:\n  model_config_file: models/tiny.yaml\n  free_memory: true\n", 1)
    top.write_text(text)
    config = load_config(str(top), world_size=1)
    assert config.weight_owner("policy") == "ppo_policy" and config.weight_owner("reference") is None
    (note,) = weight_sharing_notes(config)
    assert note.startswith("policy shares ppo_policy's weight storage, so policy's offload_weights=True moves")
    config.policy.precision = "fp32"  # another dtype than ppo_policy's bf16: a copy of its own, nothing shared
    assert config.weight_owner("policy") is None and weight_sharing_notes(config) == []


def test_settings_that_need_fixed_device_addresses_are_refused_where_ems_moves_the_role(tmp_path):
    def ppo_policy_with(keys: str, policy_free: bool):
        top = tiny_setup(tmp_path)
        text = top.read_text().replace(
            "ppo_policy:\n  model_config_file: models/tiny.yaml\n", f"ppo_policy:\n  model_config_file: models/tiny.yaml\n{keys}", 1)
        text = text.replace("policy:\n  model_config_file: models/tiny.yaml\n",
                            f"policy:\n  model_config_file: models/tiny.yaml\n  free_memory: {str(policy_free).lower()}\n", 1)
        top.write_text(text)
        return str(top)

    with pytest.raises(ConfigError) as raised:
        load_config(ppo_policy_with("  cuda_graph_impl: local\n  nccl_ub: true\n  free_memory: true\n", False), world_size=1)
    message = str(raised.value)
    assert "ppo_policy.cuda_graph_impl: 'local' cannot be used with EMS: CUDA graphs replay the device addresses" in message
    assert "ppo_policy.nccl_ub: True cannot be used with EMS: NCCL registers DDP's buffers once" in message
    assert "(ppo_policy.offload_weights, ppo_policy.free_grad_buffers, ppo_policy.offload_optimizer_state on)" in message
    # The policy shares ppo_policy's weight storage: its offload_weights moves it too.
    with pytest.raises(ConfigError, match=r"ppo_policy\.cuda_graph_impl: 'local' cannot be used with EMS: .* \(policy\.offload_weights on\)"):
        load_config(ppo_policy_with("  cuda_graph_impl: local\n", True), world_size=1)
    assert load_config(ppo_policy_with("  cuda_graph_impl: local\n", False), world_size=1).ppo_policy.cuda_graph_impl == "local"
    with pytest.raises(ConfigError, match=r"ppo_policy\.overlap_param_gather: true is not supported: .* the serving role policy reads"):
        load_config(ppo_policy_with("  overlap_param_gather: true\n", False), world_size=1)


# --- the algorithm and its roles ----------------------------------------------------------------

def critic_free_setup(tmp_path: Path, extra: str, roles=("policy", "reference", "reward", "ppo_policy")) -> Path:
    write(tmp_path / "models" / "tiny.yaml", "model:\n  preset: tiny\n")
    text = "".join(f"{r}:\n  model_config_file: models/tiny.yaml\n" for r in roles)
    return write(tmp_path / "rlhf.yaml", text + textwrap.dedent(extra))


def test_a_critic_free_estimator_runs_four_roles_and_needs_groups(tmp_path):
    config = load_config(str(critic_free_setup(tmp_path, """
        algorithm: {advantage_estimator: grpo}
        generation: {samples_per_prompt: 4}
        ppo: {rollout_batch_size: 8}
    """)), world_size=2)
    assert config.roles == config.model_roles == ("policy", "reference", "reward", "ppo_policy")
    assert config.trainable_roles == ("ppo_policy",) and config.served_weights == {"policy": "ppo_policy"}
    assert config.rollout_samples == 32 and config.samples_per_step("ppo_policy") == 32


def test_a_critic_configured_for_grpo_is_reported_with_the_roles_it_runs(tmp_path):
    top = critic_free_setup(tmp_path, """
        algorithm:
          advantage_estimator: ${MRLHF_ESTIMATOR:grpo}
        generation: {samples_per_prompt: 4}
    """, roles=ROLES)
    with pytest.raises(ConfigError) as e:
        load_config(str(top))
    text = str(e.value)
    for role in ("value", "ppo_value"):
        assert f"rlhf.yaml: {role}: configured, but algorithm.advantage_estimator=grpo has no critic: it runs " \
               "policy, reference, reward, ppo_policy" in text


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_and_dynamic_sampling_need_several_samples_per_prompt(tmp_path, estimator):
    top = critic_free_setup(tmp_path, f"algorithm: {{advantage_estimator: {estimator}, dynamic_sampling: true}}\n")
    with pytest.raises(ConfigError, match=f"generation.samples_per_prompt: {estimator} compares the responses"):
        load_config(str(top))
    # REINFORCE++ has no group baseline, but dynamic sampling still needs groups.
    top = critic_free_setup(tmp_path, "algorithm: {advantage_estimator: reinforce_plus_plus, dynamic_sampling: true}\n")
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling: drops groups .*samples_per_prompt >= 2"):
        load_config(str(top))


def test_group_sampling_and_clip_settings_are_checked(tmp_path):
    top = critic_free_setup(tmp_path, """
        algorithm: {advantage_estimator: grpo, overlong_buffer_length: 16}
        generation: {samples_per_prompt: 4, greedy: true, max_new_tokens: 16}
        ppo: {rollout_batch_size: 3, clip_ratio_low: 1.2, clip_ratio_high: -0.1}
    """)
    with pytest.raises(ConfigError) as e:
        load_config(str(top), world_size=2)
    text = str(e.value)
    assert "generation.samples_per_prompt: greedy decoding gives every response to a prompt the same tokens" in text
    assert "algorithm.overlong_buffer_length: must be below the model's tokens per response (generation.max_new_tokens " \
           "= 16), got 16" in text
    assert "ppo.clip_ratio_low: the ratio is clipped below at 1 - 1.2" in text
    assert "ppo.clip_ratio_high: must be >= 0, got -0.1" in text
    assert "ppo.rollout_batch_size: 3 is not divisible by DP = 2" in text


def test_every_numeric_key_is_checked_against_its_domain_all_at_once(tmp_path, monkeypatch):
    """Domains live beside the keys (schema.bounded); a negative KL coefficient or zero lengths are
    reported together, each by file, key and environment variable, without consequences of them."""
    from megatron_rlhf.config.schema import RLHFConfig
    from megatron_rlhf.config.validation import domain_problems

    monkeypatch.setenv("KL_COEF", "-1")
    monkeypatch.setenv("MAX_NEW_TOKENS", "0")
    (tmp_path / "rlhf.yaml").write_text(f"includes: {os.path.abspath('examples/tiny/rlhf.yaml')}\n"
                                       "ppo:\n  gamma: 1.5\n  ppo_epochs: 0\nreward:\n  timeout_s: 0\n"
                                       "policy:\n  micro_batch_size: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "rlhf.yaml"), world_size=2)
    text = str(e.value)
    for expected in ("ppo.kl_coef (environment variable KL_COEF=-1): must be >= 0, got -1.0",
                     "generation.max_new_tokens (environment variable MAX_NEW_TOKENS=0): must be >= 1, got 0",
                     "ppo.gamma: must be >= 0 and <= 1, got 1.5", "ppo.ppo_epochs: must be >= 1, got 0",
                     "reward.timeout_s: must be > 0, got 0", "policy.micro_batch_size: must be >= 1, got 0"):
        assert expected in text, text
    assert "overlong" not in text  # no consequence of max_new_tokens: 0
    assert domain_problems(RLHFConfig()) == []  # every default is in its domain


def test_a_config_file_that_is_not_utf8_names_its_line(tmp_path):
    (tmp_path / "rlhf.yaml").write_bytes(b"seed: 1\n# caf\xae\nppo: {iterations: 2}\n")
    with pytest.raises(ConfigError, match=r"rlhf\.yaml:2: not UTF-8 text; save the file as UTF-8"):
        load_config(str(tmp_path / "rlhf.yaml"))


@pytest.mark.parametrize("reward, dynamic, expected", [
    ("function", False, {"policy": "reference", "reference": "value", "value": "ppo_policy", "ppo_policy": "ppo_value"}),
    ("model", False, {"policy": "reward", "reward": "reference", "reference": "value", "value": "ppo_policy",
                      "ppo_policy": "ppo_value"}),
    ("model", True, {"policy": "reward", "reference": "value", "value": "ppo_policy", "ppo_policy": "ppo_value"}),
    ("function", True, {"reference": "value", "value": "ppo_policy", "ppo_policy": "ppo_value"}),
])
def test_successions_follow_the_phase_order_and_stop_where_sampling_may_go_round_again(reward, dynamic, expected):
    import dataclasses

    config = load_config(str(REPO / "examples/tiny/rlhf.yaml"), world_size=2)
    config = dataclasses.replace(config, reward=dataclasses.replace(config.reward, type=reward),
                                 algorithm=dataclasses.replace(config.algorithm, dynamic_sampling=dynamic))
    assert config.successions == expected


def layouts_setup(tmp_path: Path, top: str, **own: str) -> Path:
    """The tiny setup with ``role="<keys of its parallel mapping>"`` for some roles."""
    write(tmp_path / "models" / "tiny.yaml", "model:\n  preset: tiny\n")
    roles = "".join(f"{r}:\n  model_config_file: models/tiny.yaml\n" + (f"  parallel: {{{own[r]}}}\n" if r in own else "")
                    for r in ROLES)
    return write(tmp_path / "rlhf.yaml", roles + top)


def test_a_serving_roles_own_layout_is_checked_like_the_runs(tmp_path):
    top = layouts_setup(tmp_path, "parallel: {tensor_model_parallel_size: 2}\n", policy="tensor_model_parallel_size: 1")
    config = load_config(str(top), world_size=2)
    assert (config.layout_of("policy").tensor_model_parallel_size, config.layout_of("ppo_policy").tensor_model_parallel_size) == (1, 2)
    assert config.has_own_layout("policy") and not config.has_own_layout("reference")
    assert config.weight_owner("policy") is None  # two layouts never share storage
    # Its own faults name its own key, and say what would be right.
    top = layouts_setup(tmp_path, "", policy="tensor_model_parallel_size: 3, pipeline_model_parallel_size: 3, "
                                             "expert_model_parallel_size: 2",
                        ppo_value="tensor_model_parallel_size: 1", reference="pipeline_model_parallel_size: 2")
    with pytest.raises(ConfigError) as err:
        load_config(str(top), world_size=4)
    text = str(err.value)
    assert "policy.parallel: TP*PP = 3*3 does not divide the world size 4; valid TP*PP: 1, 2, 4" in text
    assert "policy.parallel.tensor_model_parallel_size: 3 does not divide policy's num_attention_heads=4" in text
    assert "policy.parallel.pipeline_model_parallel_size: 3 does not divide policy's num_layers=2" in text
    assert "ppo_value.parallel: ppo_value is trained, and trained roles run at the run's layout" in text
    assert "reference.parallel: reference at its own layout needs reference.load" in text
    assert "policy.parallel.expert_model_parallel_size: policy's model has no experts; remove it" in text
    assert "does not divide policy, " not in text  # the run's layout is fine for the other roles


def test_a_policy_of_its_own_expert_layout_and_what_routing_replay_needs(monkeypatch):
    from megatron_rlhf.config.validation import layout_problems

    monkeypatch.delenv("TP", raising=False)
    monkeypatch.delenv("EP", raising=False)
    config = load_config(os.path.join(REPO, "examples", "tiny", "moe.yaml"), world_size=4, check_inputs=False)
    config.policy.parallel.expert_model_parallel_size = 4
    assert layout_problems(config, 4) == []  # EP=4 of DP=4 at TP=1
    config.policy.parallel.expert_model_parallel_size = 3
    assert any("policy.parallel: EP 3 does not divide policy's data-parallel size 4" in p for p in layout_problems(config, 4))
    config.policy.parallel.expert_model_parallel_size = None
    config.policy.parallel.pipeline_model_parallel_size = 2  # the routing record is per stage: PP as training's
    assert any("policy.parallel.pipeline_model_parallel_size: PP 2, but moe.routing_replay: rollout records each pipeline stage's layers" in p
               for p in layout_problems(config, 4))
    config.moe.routing_replay = "off"
    assert layout_problems(config, 4) == []


def test_multi_turn_settings_are_refused_by_name_where_they_would_go_unused_or_are_not_modelled(tmp_path):
    # Without an environment no rollout.* key has an effect: each is named.
    with pytest.raises(ConfigError) as err:
        load_config(str(tiny_setup(tmp_path, "rollout: {max_turns: 3, stop: ['x']}\n")), world_size=1)
    assert "rollout.max_turns: set, but neither rollout.environment nor rollout.tools is" in str(err.value)
    assert "rollout.stop: set, but neither rollout.environment nor rollout.tools is" in str(err.value)
    ok = load_config(str(tiny_setup(tmp_path, "rollout: {environment: env.py:Game, max_turns: 3, "
                                    "max_trajectory_tokens: 200}\n")), world_size=1)
    assert ok.rollout.turn_tokens(ok.generation) == ok.generation.max_new_tokens and ok.sequence_tokens == 200
    # The default context (prompt + turns x (turn + observation)) beyond the model's positions.
    with pytest.raises(ConfigError, match=r"rollout.max_trajectory_tokens: a trajectory's tokens = \d+ exceeds "
                                          r"policy's max_position_embeddings=256"):
        load_config(str(tiny_setup(tmp_path, "rollout: {environment: env.py:Game, max_turns: 3}\n")), world_size=1)
    # With one: a context with no room for a turn is refused; DAPO's overlong buffer is measured
    # against the turns' model tokens; the policy may run at a layout of its own.
    top = layouts_setup(tmp_path, "parallel: {tensor_model_parallel_size: 2}\nrollout: {environment: env.py:Game, "
                        "max_trajectory_tokens: 64, max_turns: 2}\ndata: {max_prompt_length: 64}\n"
                        "algorithm: {overlong_buffer_length: 16}\ngeneration: {max_new_tokens: 8}\n",
                        policy="tensor_model_parallel_size: 1")
    with pytest.raises(ConfigError) as err:
        load_config(str(top), world_size=2)
    text = str(err.value)
    assert "multi-turn rollouts run the policy" not in text and "policy.parallel" not in text
    assert "rollout.max_trajectory_tokens: 64 leaves no room for a turn" in text
    assert "algorithm.overlong_buffer_length: must be below the model's tokens per response (rollout.max_turns x the " \
           "turn's tokens = 16), got 16" in text


def test_the_policy_losses_are_chosen_by_name_and_gspo_needs_its_sequence_mean(tmp_path):
    ok = load_config(str(tiny_setup(tmp_path, "ppo: {policy_loss: gspo, loss_agg_mode: seq-mean-token-mean, "
                                    "clip_ratio_low: 0.0003, clip_ratio_high: 0.0004, clip_ratio_c: 3.0}\n")), world_size=1)
    assert ok.ppo.policy_loss == "gspo" and ok.ppo.clip_ratio_c == 3.0
    assert ok.response_tokens == ok.generation.max_new_tokens
    with pytest.raises(ConfigError) as err:
        load_config(str(tiny_setup(tmp_path, "ppo: {policy_loss: gspo, clip_ratio_c: 1.0}\n")), world_size=1)
    text = str(err.value)
    assert "ppo.loss_agg_mode: GSPO's objective is a mean over sequences" in text and "seq-mean-token-mean" in text
    assert "ppo.clip_ratio_c" in text
    with pytest.raises(ConfigError, match="ppo.policy_loss.*vanilla.*gspo"):
        load_config(str(tiny_setup(tmp_path, "ppo: {policy_loss: cispo}\n")), world_size=1)


def test_tool_settings_are_refused_by_name_where_they_cannot_work(tmp_path):
    top = ("rollout: {tools: [t.py:add], environment: env.py:Game, tool_timeout_s: 30, env_timeout_s: 30, "
           "max_trajectory_tokens: 200}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(tiny_setup(tmp_path, top)), world_size=1)
    text = str(err.value)
    assert "rollout.tools: the tools run in the built-in tool environment" in text
    assert "rollout.tool_timeout_s: 30s must stay below rollout.env_timeout_s=30s" in text
    assert "rollout.tool_parser: hermes calls are shown to the model through the chat template" in text
    with pytest.raises(ConfigError, match="rollout.tool_parser: set, but rollout.tools is empty"):
        load_config(str(tiny_setup(tmp_path, "rollout: {environment: env.py:Game, tool_parser: tags, "
                                             "max_trajectory_tokens: 200}\n")), world_size=1)
    ok = load_config(str(tiny_setup(tmp_path, "rollout: {tools: [t.py:add], tool_parser: tags, "
                                              "max_trajectory_tokens: 200}\n")), world_size=1)
    assert ok.rollout.multi_turn and ok.sequence_tokens == 200


def test_sandbox_settings_are_read_by_their_kind_only(tmp_path):
    tools = "rollout: {tools: [t.py:add], tool_parser: tags, max_trajectory_tokens: 200, sandbox: %s}\n"
    cases = [("{url: 'http://sandbox:8080'}", "rollout.sandbox.url: set, but rollout.sandbox.kind is isolated; it is "
                                              "read by kind remote only"),
             ("{kind: remote}", "rollout.sandbox.url: kind remote needs the SandboxFusion service's base URL"),
             ("{kind: remote, url: 'sandbox:8080', inodes: 100}", "rollout.sandbox.inodes: set, but rollout.sandbox.kind "
                                                                  "is remote; it is read by kind isolated only"),
             ("{kind: remote, url: 'http://sandbox:8080', open_files: 32}", "rollout.sandbox.open_files: set, but "
              "rollout.sandbox.kind is remote; it is read by kind isolated and unsafe_process only"),
             ("{wall_s: 20}", "rollout.sandbox.wall_s: 20s must stay at least a second below rollout.tool_timeout_s=20s"),
             ("{kind: sealed}", "rollout.sandbox.kind"),
             ("{disk_mb: 0}", "rollout.sandbox.disk_mb")]
    for value, words in cases:
        with pytest.raises(ConfigError) as err:
            load_config(str(tiny_setup(tmp_path, tools % value)), world_size=1)
        assert words in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="rollout.sandbox.kind: rollout.sandbox is the Python tool's of rollout.tools"):
        load_config(str(tiny_setup(tmp_path, "rollout: {environment: env.py:Game, max_trajectory_tokens: 200, "
                                             "sandbox: {kind: unsafe_process}}\n")), world_size=1)
    ok = load_config(str(tiny_setup(tmp_path, tools % "{kind: remote, url: 'http://sandbox:8080', retries: 0}")),
                     world_size=1)
    assert ok.rollout.sandbox.url == "http://sandbox:8080" and ok.rollout.sandbox.retries == 0


def test_a_tool_that_cannot_be_loaded_stops_the_run_before_start_up(tmp_path):
    from megatron_rlhf.startup import _tool_specs

    (tmp_path / "t.py").write_text("def add(a: int):\n    return a\n")
    config = load_config(str(tiny_setup(tmp_path, "rollout: {tools: [t.py:add], tool_parser: tags, "
                                                  "max_trajectory_tokens: 200}\n")), world_size=1)
    with pytest.raises(ConfigError, match=r"rollout.tools: tool .*t.py:add: no schema can be made"):
        _tool_specs(config)


def _role_setup(tmp_path, role: str, lines: str):
    """tiny_setup with ``lines`` (indented keys) added to ``role``'s entry."""
    top = tiny_setup(tmp_path)
    entry = f"{role}:\n  model_config_file: models/tiny.yaml\n"
    text = top.read_text()
    at = next(i for i in range(len(text)) if text.startswith(entry, i) and (i == 0 or text[i - 1] == "\n"))
    top.write_text(text[: at + len(entry)] + lines + text[at + len(entry):])
    return top


def test_micro_batches_by_tokens_need_their_budget_hold_the_longest_row_and_run_unpipelined(tmp_path):
    ok = load_config(str(_role_setup(tmp_path, "ppo_policy", "  micro_batch_size: auto\n  max_tokens_per_micro_batch: 512\n")),
                     world_size=1)
    assert ok.ppo_policy.token_budget == 512 and ok.reference.token_budget is None
    cases = [
        ("ppo_policy", "  micro_batch_size: auto\n",
         "ppo_policy.micro_batch_size: auto packs micro-batches by tokens; set ppo_policy.max_tokens_per_micro_batch"),
        ("reference", "  max_tokens_per_micro_batch: 512\n",
         "reference.max_tokens_per_micro_batch: set, but reference.micro_batch_size is"),
        ("ppo_policy", "  micro_batch_size: auto\n  max_tokens_per_micro_batch: 8\n",
         "ppo_policy.max_tokens_per_micro_batch: 8 is below the longest row a rollout holds"),
    ]
    for role, lines, words in cases:
        with pytest.raises(ConfigError) as err:
            load_config(str(_role_setup(tmp_path, role, lines)), world_size=1)
        assert words in str(err.value), str(err.value)


def test_a_system_prompt_without_a_template_and_a_weight_that_is_not_finite_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="data.system_prompt: set, but data.apply_chat_template is false"):
        load_config(str(tiny_setup(tmp_path, "data: {system_prompt: be brief}\n")), world_size=1)
    for weight, words in ((".nan", r"reward.functions.a.py:f: expected float, got float nan \(a number must be finite\)"),
                          (".inf", r"reward.functions.a.py:f: expected float, got float inf"),
                          ("'high'", "reward.functions.a.py:f: expected float, got str 'high'")):
        with pytest.raises(ConfigError, match=words):
            load_config(str(tiny_setup(tmp_path, f"reward: {{type: function, functions: {{'a.py:f': {weight}}}}}\n")),
                        world_size=1)


def test_partial_rollouts_and_rollout_correction_are_refused_by_name_where_they_cannot_work(tmp_path):
    ok = load_config(str(tiny_setup(tmp_path, "rollout: {partial: {enabled: true, over_sample: 1.5}}\n"
                                    "algorithm: {rollout_correction: {mode: mask, level: sequence, threshold: 3}}\n")),
                     world_size=1)
    assert ok.rollout.partial.pool_groups(ok.ppo.rollout_batch_size) == 96 and not ok.rollout.multi_turn
    with pytest.raises(ConfigError, match="rollout.partial.chunk_turns: counts turns of trajectories with an environment"):
        load_config(str(tiny_setup(tmp_path, "rollout: {partial: {enabled: true, chunk_turns: 2}}\n")), world_size=1)
    assert ok.algorithm.rollout_correction.band == (1 / 3, 3.0)
    # Unused: partial settings while it is off, correction settings while it is off.
    with pytest.raises(ConfigError) as err:
        load_config(str(tiny_setup(tmp_path, "rollout: {partial: {over_sample: 3}}\n"
                                   "algorithm: {rollout_correction: {threshold: 3}}\n")), world_size=1)
    text = str(err.value)
    assert "rollout.partial.over_sample: set, but rollout.partial.enabled is false" in text
    assert "algorithm.rollout_correction.threshold: set, but algorithm.rollout_correction.mode is off" in text
    # Not modelled: a chunk of tokens with an environment; a band for truncate; a pool that does not split over DP.
    top = ("rollout: {environment: env.py:Game, max_trajectory_tokens: 200, partial: {enabled: true, over_sample: 1.01, "
           "chunk_tokens: 4}}\n"
           "algorithm: {rollout_correction: {mode: truncate, threshold_low: 0.5}}\nppo: {rollout_batch_size: 4}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(tiny_setup(tmp_path, top)), world_size=2)
    text = str(err.value)
    assert "rollout.partial.chunk_tokens: with an environment a trajectory is held at a turn's start, so a chunk is " \
        "counted in turns: set rollout.partial.chunk_turns instead" in text
    assert "algorithm.rollout_correction.mode: not supported" not in text  # the engine records agents' tokens too
    assert "algorithm.rollout_correction.threshold_low: only mask keeps a band" in text
    assert "1.01 x ppo.rollout_batch_size=4 = 5 prompts in flight, x samples_per_prompt=1 = 5 responses, do not split over DP=2" in text


def _lora_setup(tmp_path: Path, top: str = "", **entries: str) -> Path:
    """The tiny setup with extra keys (``role="key: value"`` lines) in some roles' entries."""
    write(tmp_path / "models" / "tiny.yaml", "model:\n  preset: tiny\n")
    roles = "".join(f"{r}:\n  model_config_file: models/tiny.yaml\n" + (f"  {entries[r]}\n" if r in entries else "")
                    for r in ROLES)
    return write(tmp_path / "rlhf.yaml", roles + top)


def test_lora_goes_on_a_trained_role_and_the_reference_becomes_the_base(tmp_path):
    config = load_config(str(_lora_setup(tmp_path, ppo_policy="lora: {rank: 8, alpha: 16}")), world_size=1)
    assert config.lora_of("policy").rank == 8 and not config.lora_of("reference").enabled
    assert config.served_weights["reference"] == "ppo_policy" and config.weight_owner("reference") == "ppo_policy"
    # A reference of another checkpoint, or of another precision, is not the base: it keeps weights of its own.
    config.reference.load = "another/checkpoint"
    assert "reference" not in config.served_weights and config.weight_owner("reference") is None
    config.reference.load, config.reference.precision = None, "bf16" if config.ppo_policy.precision == "fp32" else "fp32"
    assert config.weight_owner("reference") is None
    with pytest.raises(ConfigError) as err:
        load_config(str(_lora_setup(tmp_path, policy="lora: {rank: 4}",
                                    ppo_policy="lora: {rank: 8, dropout: 0.05, target_modules: [linear_qkv, q_proj]}",
                                    ppo_value="lora: {alpha: 8}\n  load_lora: adapter",
                                    reference="load_lora: adapter")), world_size=1)
    text = str(err.value)
    assert "reference.load_lora: a PEFT adapter starts ppo_policy's LoRA adapters (a language model's); reference " \
           "takes none: remove it" in text
    assert "ppo_value.load_lora: a PEFT adapter starts ppo_policy's LoRA adapters" in text
    with pytest.raises(ConfigError, match=r"ppo_policy.load_lora: a PEFT adapter starts ppo_policy's LoRA adapters "
                                          r"\(set its lora: rank, alpha and target_modules as the adapter's\)"):
        load_config(str(_lora_setup(tmp_path, ppo_policy="load_lora: adapter")), world_size=1)
    assert "policy.lora: policy is not trained; it runs ppo_policy's adapters: set ppo_policy.lora" in text
    assert "ppo_policy.lora.dropout: 0.05, but RL needs the log-probs of the rollout and of training" in text
    assert "ppo_policy.lora.target_modules: ['q_proj']; choose among linear_qkv, linear_proj, linear_fc1, linear_fc2" in text
    assert "ppo_value.lora.alpha: set, but ppo_value.lora.rank is 0 (off); set a rank or remove it" in text
    top = layouts_setup(tmp_path, "parallel: {tensor_model_parallel_size: 2}\n", policy="tensor_model_parallel_size: 1")
    text = top.read_text().replace("ppo_policy:\n  model_config_file: models/tiny.yaml\n",
                                   "ppo_policy:\n  model_config_file: models/tiny.yaml\n  lora: {rank: 4}\n")
    top.write_text(text)
    config = load_config(str(top), world_size=2)  # the policy at its own layout runs the adapters resharded
    assert config.has_own_layout("policy") and config.lora_of("policy").rank == 4


def test_a_network_problem_names_the_file_that_set_the_field(monkeypatch):
    # num_experts is set in moe.yaml; the roles' model mapping starts in base_model.yaml.
    monkeypatch.setenv("EP", "3")
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join("examples", "tiny", "moe.yaml"), world_size=6)
    assert "3 does not divide policy, reference, ppo_policy's num_experts=4 (" in str(err.value)
    assert "moe.yaml); valid EP: 1, 2, 4" in str(err.value) and "base_model.yaml" not in str(err.value)


def test_a_wrong_entry_of_a_mapping_names_its_own_file_and_nothing_else_follows(tmp_path):
    # The recipe's reward.functions are fine; the user's file adds a weight that is not a number.
    top = write(tmp_path / "cfg.yaml", f"includes: {os.path.abspath('examples/tiny_math/grpo.yaml')}\n"
                "reward:\n  functions:\n    megatron_rlhf.rewards.verifiers:gsm8k: abc\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(top), world_size=2)
    lines = str(err.value).splitlines()[1:]
    assert lines == [f"  {top}: reward.functions.megatron_rlhf.rewards.verifiers:gsm8k: expected float, got str 'abc'"]


def test_an_including_file_switches_the_recipes_verifier_with_null(tmp_path):
    recipe = os.path.abspath("examples/tiny_math/grpo.yaml")
    top = write(tmp_path / "cfg.yaml", f"includes: {recipe}\nreward:\n  functions:\n"
                "    megatron_rlhf.rewards.verifiers:gsm8k: null\n    megatron_rlhf.rewards.verifiers:math: 1.0\n")
    config = load_config(str(top), world_size=2)
    assert config.reward.functions == {"megatron_rlhf.rewards.verifiers:answer_format": 0.2,
                                       "megatron_rlhf.rewards.verifiers:math": 1.0}
    assert config.source_of("reward.functions.megatron_rlhf.rewards.verifiers:math") == str(top)
    wrong = write(tmp_path / "wrong.yaml", f"includes: {recipe}\nreward:\n  functions:\n"
                  "    megatron_rlhf.rewards.verifiers:gsm9k: null\n")
    with pytest.raises(ConfigError, match=rf"{wrong}: reward.functions.megatron_rlhf.rewards.verifiers:gsm9k: null "
                                          "removes an entry an included file sets, but none sets"):
        load_config(str(wrong), world_size=2)


def test_preset_auto_takes_the_architecture_of_the_checkpoint_a_role_starts_from(tmp_path):
    import torch

    from megatron_rlhf.checkpoint.model_files import write_model_meta
    from megatron_rlhf.config.presets import PRESETS
    from megatron_rlhf.config.schema import ModelArchConfig

    arch = ModelArchConfig(**{**PRESETS["tiny"], "family": "qwen2", "num_layers": 3, "hidden_size": 96,
                              "num_attention_heads": 6, "num_query_groups": 2, "tie_word_embeddings": True})
    for name, head in (("policy_ckpt", "lm"), ("reward_ckpt", "scalar")):
        (tmp_path / name).mkdir()
        write_model_meta(str(tmp_path / name), arch, head, torch.float32, 1, 1)
    write(tmp_path / "models" / "auto.yaml", "model:\n  preset: auto\n  init_method_std: 0.05\n")
    loads = {"reference": "policy_ckpt", "ppo_policy": "policy_ckpt", "reward": "reward_ckpt", "value": "reward_ckpt",
             "ppo_value": "reward_ckpt"}
    roles = "".join(f"{r}:\n  model_config_file: models/auto.yaml\n" + (f"  load: {loads[r]}\n" if r in loads else "")
                    for r in ROLES)
    config = load_config(str(write(tmp_path / "rlhf.yaml", roles)), world_size=1, check_inputs=False)
    for role in ROLES:  # the policy's from ppo_policy's checkpoint (the weights it serves)
        model = config.role(role).model
        assert (model.family, model.num_layers, model.hidden_size, model.num_query_groups) == ("qwen2", 3, 96, 2), role
        assert model.qkv_bias and model.init_method_std == 0.05  # the family's features; a key set in a file wins
    del loads["ppo_policy"]
    roles = "".join(f"{r}:\n  model_config_file: models/auto.yaml\n" + (f"  load: {loads[r]}\n" if r in loads else "")
                    for r in ROLES)
    with pytest.raises(ConfigError) as err:
        load_config(str(write(tmp_path / "rlhf.yaml", roles)), world_size=1, check_inputs=False)
    assert "policy.model.preset: auto takes the architecture from ppo_policy.load's converted checkpoint, but " \
           "ppo_policy.load is not set; convert it (tools/convert_hf_to_megatron.py) or name a preset" in str(err.value)
    assert "missing num_layers" not in str(err.value)  # said once, by its cause


# --- key=value on the command line, and keys that would do nothing -------------------------------

def test_command_line_overrides_are_checked_as_the_files_keys_are(tmp_path, monkeypatch):
    """``key=value`` after the config: typed as an environment variable's value (or a YAML list or
    mapping), over every file and variable, with the same checks (an unknown key, a wrong type, a
    value out of its domain each named with "the command line"), and in the run's fingerprint."""
    from megatron_rlhf.checkpoint.run_state import run_identity

    top = str(REPO / "examples" / "tiny" / "grpo.yaml")
    monkeypatch.setenv("KL_COEF", "0.2")
    config = load_config(top, world_size=2, overrides=["ppo.kl_coef=0.05", "ppo_policy.lr=2e-5",
                                                        "policy.model={init_method_std: 0.05}", "ppo_policy.model={init_method_std: 0.05}",
                                                        "trainer.output_dir=runs/mine"])
    assert (config.ppo.kl_coef, config.ppo_policy.lr, config.policy.model.init_method_std) == (0.05, 2e-5, 0.05)
    assert config.policy.model.hidden_size == load_config(top, world_size=2).policy.model.hidden_size  # merged
    assert config.at("ppo.kl_coef").startswith("the command line")
    assert config.path_of("trainer.output_dir") == os.path.join(os.getcwd(), "runs/mine")  # the working directory's
    assert run_identity(config)["fingerprint"] != run_identity(load_config(top, world_size=2))["fingerprint"]
    with pytest.raises(ConfigError) as refused:
        load_config(top, world_size=2, overrides=["ppo.kl_cof=1", "ppo_policy.lr=fast", "ppo.clip_ratio=-1"])
    said = str(refused.value)
    assert "the command line: ppo.kl_cof: unknown key; did you mean 'kl_coef'?" in said
    assert "the command line: ppo_policy.lr: expected float, got str 'fast'" in said
    assert "the command line: ppo.clip_ratio" in said
    with pytest.raises(ConfigError, match=r"the command line: 'ppo.kl_coef': expected KEY=VALUE"):
        load_config(top, world_size=2, overrides=["ppo.kl_coef"])


def test_command_line_overrides_merge_key_by_key_and_their_paths_are_the_working_directory_s(tmp_path, monkeypatch):
    """A later mapping updates a section a dotted key set (once it replaced it, dropping the key),
    a key a dotted key and a mapping give two values is refused by name (of two dotted keys the
    later wins), and a relative path given on the command line, alone
    or inside a mapping, is the working directory's (once the root's)."""
    from megatron_rlhf.rewards.contract import reward_functions

    top = str(REPO / "examples" / "tiny" / "grpo.yaml")
    config = load_config(top, world_size=2, overrides=["ppo.kl_coef=0.2", "ppo={clip_ratio: 0.3}"])
    assert (config.ppo.kl_coef, config.ppo.clip_ratio) == (0.2, 0.3)
    with pytest.raises(ConfigError, match=r"the command line: ppo.kl_coef is given two values \(0.2, then 0.3\), one of "
                                          r"them inside a mapping; give it once"):
        load_config(top, world_size=2, overrides=["ppo.kl_coef=0.2", "ppo={kl_coef: 0.3}"])
    (tmp_path / "rw.py").write_text("def f(prompts, completions, **kwargs):\n    return [1.0 for _ in completions]\n")
    monkeypatch.chdir(tmp_path)
    alone = load_config(top, world_size=2, overrides=["reward.function=rw.py:f"])
    assert reward_functions(alone) == {f"{tmp_path / 'rw.py'}:f": 1.0}
    mapped = load_config(top, world_size=2, overrides=["reward.function=null", "reward.functions={rw.py:f: 0.5}"])
    assert reward_functions(mapped) == {f"{tmp_path / 'rw.py'}:f": 0.5}


@pytest.mark.parametrize("config, key, said", [
    ("examples/tiny/grpo.yaml", "policy.lr", "set ppo_policy.lr instead (policy runs its weights)"),
    ("examples/tiny/grpo.yaml", "reference.clip_grad", "remove it (reference is frozen; trained: ppo_policy)"),
    ("examples/tiny/rlhf.yaml", "value.weight_decay", "set ppo_value.weight_decay instead (value runs its weights)"),
    ("examples/tiny_pipeline/dpo.yaml", "reference.lr", "remove it (reference is frozen; trained: policy)"),
])
def test_a_trained_roles_key_on_a_role_the_stage_does_not_train_is_refused_with_the_key_that_does(config, key, said):
    from megatron_rlhf.config.reference import explain

    with pytest.raises(ConfigError, match=rf"the command line: {key}: stage \w+ does not train {key.split('.')[0]}, "
                                          rf"so {key} would do nothing; {said.replace('(', '[(]').replace(')', '[)]')}"):
        load_config(str(REPO / config), world_size=2, overrides=[f"{key}=0.5"])
    assert "in rl set ppo_policy.lr (policy runs its weights)" in explain("policy.lr")
    assert "read by: sft, dpo, where policy is trained" in explain("policy.lr")


@pytest.mark.parametrize("config, key, said", [
    ("examples/tiny/rlhf.yaml", "value.logprob_chunk_tokens", "value has a scalar head"),
    ("examples/tiny/rlhf.yaml", "ppo_value.logprob_chunk_tokens", "ppo_value has a scalar head"),
])
def test_a_log_prob_chunk_on_a_role_without_log_probs_is_refused(config, key, said):
    with pytest.raises(ConfigError, match=rf"the command line: {key}: {said}, so no log-probs are computed from its "
                                          "logits; remove it"):
        load_config(str(REPO / config), world_size=2, overrides=[f"{key}=64"])
    assert load_config(str(REPO / config), world_size=2, overrides=["ppo_policy.logprob_chunk_tokens=64"]) \
        .logprob_chunk_tokens("ppo_policy") == 64


@pytest.mark.parametrize("key, value", [("ppo_policy.lr", "inf"), ("ppo.kl_coef", "nan"), ("ppo.clip_ratio", "-inf")])
def test_a_number_that_is_not_finite_is_refused_before_start_up(key, value):
    """An infinite learning rate, a NaN coefficient: refused with the key, not at the first step."""
    with pytest.raises(ConfigError, match=rf"the command line: {re.escape(key)}: expected float, got float "
                                          rf"-?{value.lstrip('-')} \(a number must be finite\)"):
        load_config(str(REPO / "examples" / "tiny" / "grpo.yaml"), world_size=2, overrides=[f"{key}={value}"])


def test_a_dpo_beta_that_is_not_finite_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"dpo.beta: expected float, got float inf \(a number must be finite\)"):
        load_config(str(REPO / "examples" / "tiny_pipeline" / "dpo.yaml"), world_size=2, overrides=["dpo.beta=inf"])
