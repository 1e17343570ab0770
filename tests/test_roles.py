import pytest


def test_weight_sync_shares_storage_or_copies(workers):
    for r in workers(2, "weight_sync"):
        assert r["shared"] and r["same_storage"] and r["policy_weight_bytes"] == 0
        assert r["owner_onloaded_with_policy"] and r["owner_offloaded_after"]
        assert r["shared_equal_after_step"]
        assert not r["copy_shared"] and r["copied_at_start"] and not r["stale_before_sync"] and r["copied"]


def test_reward_function_from_a_file_or_a_module(tmp_path):
    from megatron_rlhf.roles.reward_function import load_reward_function, score_with_function

    (tmp_path / "rules.py").write_text("def length(prompts, responses):\n    return [len(r) for r in responses]\n")
    fn = load_reward_function("rules.py:length", str(tmp_path))
    assert score_with_function(fn, ["p", "q"], ["ab", ""]).tolist() == [2.0, 0.0]
    assert load_reward_function("os.path:basename", str(tmp_path)) is __import__("os").path.basename
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        load_reward_function("rules.py:missing", str(tmp_path))
    with pytest.raises(ValueError, match="no file"):
        load_reward_function("nothere.py:f", str(tmp_path))



def test_reward_function_contract_names_the_function_what_came_back_and_the_response(tmp_path):
    """Fault 6 of the reliability trials: every breach is a RewardFunctionError with a useful text."""
    from megatron_rlhf.errors import NonFiniteError, RewardFunctionError
    from megatron_rlhf.roles.reward_function import check_scores, load_reward_function, score_with_function

    (tmp_path / "rules.py").write_text(
        "def picky(prompts, responses):\n"
        "    return [1.0 / (len(r) - 2) for r in responses]\n"  # line 2 fails for a 2-letter response
        "def strings(prompts, responses):\n    return ['0.5' for r in responses]\n"
        "def scalar(prompts, responses):\n    return 0.5\n"
        "def nothing(prompts, responses):\n    pass\n"
        "def short(prompts, responses):\n    return [0.0] * (len(responses) - 1)\n")
    prompts, responses = ["p0", "p1", "p2"], ["abc", "ab", "abcd"]
    expected = {
        "picky": r"rules.picky raised ZeroDivisionError: float division by zero at .*rules.py:2 .* on response 1 \(prompt 'p1'\)",
        "strings": r"rules.strings returned str '0.5' for response 0; expected a list of 3 numbers",
        "scalar": r"rules.scalar returned float 0.5; expected a list of 3 numbers",
        "nothing": r"rules.nothing returned NoneType None; expected",
        "short": r"rules.short returned 2 values for 3 responses",
    }
    for name, message in expected.items():
        fn = load_reward_function(f"rules.py:{name}", str(tmp_path))
        fn.__module__ = "rules"
        with pytest.raises(RewardFunctionError, match=message):
            score_with_function(fn, prompts, responses)
    (tmp_path / "broken.py").write_text("def f(prompts, responses)\n    return []\n")
    with pytest.raises(ValueError, match=r"broken.py:1: syntax error"):
        load_reward_function("broken.py:f", str(tmp_path))
    # 1e30 is finite but beyond the bound: named with its response, prompt and the key to change.
    import torch

    with pytest.raises(NonFiniteError, match=r"iteration 3: the reward gave 1e\+30 for response 1 \(prompt 'p1'\).*"
                       r"reward.max_abs_score"):
        check_scores(torch.tensor([0.5, 1e30, float("nan")]), 1e4, 3, prompts)
    check_scores(torch.tensor([0.5, -1e4]), 1e4, 3, prompts)  # within the bound: no error
