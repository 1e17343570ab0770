"""Control collectives (flags, counts, metrics, Python objects) go over the host groups
(runtime/host_groups.py), never over the device's: NCCL takes no CPU tensor. Checked on the CPU by
patching the collectives as NCCL would refuse them (tests/workers/common.StrictCollectives), and on
a GPU by NCCL itself."""

import pytest

from tests.conftest import ON_GPU

# The control paths that put CPU tensors on the device's group before the host groups: the background
# save's poll and its errors, the checkpoint's writer and manifest, the agents' metrics with the policy
# at its own layout, and the smoke test's parameter count (host_sum).
NAMED_PATHS = ("megatron_rlhf/runtime/host_groups.py:every_rank", "megatron_rlhf/checkpoint/background.py:_finish",
               "megatron_rlhf/checkpoint/run_checkpoint.py:_write_manifest",
               "megatron_rlhf/rollout/collector.py:as_run_share", "megatron_rlhf/runtime/host_groups.py:host_sum")


def test_every_control_collective_of_rl_a_stage_and_the_smoke_test_goes_over_a_host_group(workers):
    """RL (the agent demo, its policy at TP=2 while the run is TP=1, background saves), SFT
    (validation, background saves) and the smoke test through the run's own entry: no host tensor
    and no Python object on a device group, and each named control path ran on a host group. (A
    mutation that sends as_run_share's sums over the policy's device group is caught by name.)"""
    for rank in workers(2, "host_collectives"):
        assert rank.runs == ["agent, policy at its own layout", "sft", "smoke"]
        assert rank.violations == []
        assert all(rank.host_sites.get(site, 0) > 0 for site in NAMED_PATHS), rank.host_sites
        assert [len(rank.metrics[name]) for name in rank.runs[:2]] == [2, 2]


@pytest.mark.gpu
def test_a_stage_and_an_rl_run_with_background_saves_run_on_nccl(workers):
    """The same runs on one GPU: the collectives on NCCL and the host groups on gloo."""
    rank = workers(1, "host_collectives", env=ON_GPU)[0]
    assert rank.runs == ["agent, policy at its own layout", "sft", "smoke"] and rank.violations == []
