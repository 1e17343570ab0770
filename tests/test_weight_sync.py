def test_weight_sync_shares_storage_or_copies(workers):
    for r in workers(2, "weight_sync"):
        assert r.shared and r.same_storage and r.policy_weight_bytes == 0
        assert r.owner_onloaded_with_policy and r.owner_offloaded_after
        assert r.shared_equal_after_step
        assert not r.copy_shared and r.copied_at_start and not r.stale_before_sync and r.copied
