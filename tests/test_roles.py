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
    with pytest.raises(ValueError, match="expected 2 finite numbers"):
        score_with_function(lambda p, r: [1.0], ["a", "b"], ["x", "y"])
