import pytest
import torch

from megatron_rlhf.memory import GRADS, MAIN_PARAMS, OPTIMIZER_STATE, WEIGHTS
from tests.conftest import run_workers


@pytest.fixture(scope="module")
def ems_units(tmp_path_factory):
    return run_workers(tmp_path_factory.mktemp("ems_units"), 1, "ems_units")[0]


def assert_same(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def assert_full_offload_is_bit_identical(results, layouts: int):
    for rank_result in results:
        assert len(rank_result.runs) == layouts * 4
        for key, runs in rank_result.runs.items():
            off, on = runs.off, runs.on
            assert off.losses == on.losses, key
            assert_same(off.params, on.params, f"{key} params")
            assert_same(off.state, on.state, f"{key} optimizer state")
            assert off.state, f"{key}: optimizer state is empty; nothing was compared"
            # Between steps every kind really was off the device.
            for moved in on.moved:
                assert moved == {GRADS: 0, MAIN_PARAMS: 0, OPTIMIZER_STATE: 0, WEIGHTS: 0}, key
            bf16 = "bf16" in key
            assert (on.resident[MAIN_PARAMS] > 0) == bf16, key
            assert on.resident[OPTIMIZER_STATE] > 0 and on.resident[GRADS] > 0


def test_training_with_full_offload_between_steps_is_bit_identical(workers):
    assert_full_offload_is_bit_identical(workers(2, "ems_bitexact"), layouts=2)


def test_moves_are_idempotent_reuse_host_buffers_and_protect_gradients(ems_units):
    r = ems_units
    before, after = r.idempotent_offload_host_bytes
    assert before == after > 0
    offloaded, host = r.offloaded_and_host_bytes  # bf16, distributed optimizer
    assert offloaded <= host <= 1.01 * offloaded and offloaded > 0
    assert r.copied_by_inference_offload == 0
    assert r.copied_after_plain_onload == r.inference_resident[WEIGHTS] > 0
    assert r.onload_twice_same
    assert r.host_buffers_reused
    inference = r.inference_resident
    assert inference[WEIGHTS] > 0
    assert inference[GRADS] == inference[MAIN_PARAMS] == inference[OPTIMIZER_STATE] == 0
    assert "backward ran since the last optimizer step" in r.grads_in_use, r.grads_in_use
    assert r.grads_kept > 0
    assert r.grads_freed_after_step == 0
    assert r.fixed_addresses == ("ppo_policy: built with overlap_param_gather=True, which needs its device storages "
                                 "never to move, but its EMS switches move weights; build it without those settings "
                                 "or turn EMS off for it"), r.fixed_addresses
    assert r.fixed_addresses_without_ems == ()


def test_the_leak_guard_reports_a_tensor_kept_on_the_device_across_an_offload(ems_units):
    r = ems_units
    assert r.clean_offload_reports == []
    expected = f"ppo_policy: weights: {r.planted_bytes:,} bytes still on the device after its offload (inference)"
    assert r.leak_warning == [f"EMS leak guard: {expected}"] and r.planted_bytes > 0
    assert r.leak_error == (f"iteration 0: EMS leak guard (trainer.memory_guard: error): {expected}; "
                            "set trainer.memory_guard: warn to go on regardless")


def test_freeing_grads_and_optimizer_state_lowers_rss_on_cpu(ems_units):
    r = ems_units.rss
    print(f"RSS {r.before / 2**20:.1f} -> {r.after / 2**20:.1f} MiB; freed state "
          f"{r.freed_state_bytes / 2**20:.1f} MiB {r.by_kind}")
    drop = r.before - r.after
    assert r.freed_state_bytes > 100 * 2**20, r
    assert drop >= 0.8 * r.freed_state_bytes, (
        f"RSS fell by {drop / 2**20:.1f} MiB, less than 80% of the "
        f"{r.freed_state_bytes / 2**20:.1f} MiB of grads and optimizer state freed"
    )
    assert r.after_kinds[GRADS] == r.after_kinds[OPTIMIZER_STATE] == 0


STATE_KINDS = (WEIGHTS, GRADS, MAIN_PARAMS, OPTIMIZER_STATE)
# Module buffers are never moved: the stated constant on top of the active role's state. For the
# tiny model that is RoPE's inverse frequencies, head_dim / 2 = 8 fp32 values (32 bytes) per role.
OTHER_CONSTANT_BYTES = 6 * 32


def state_bytes(record):
    return sum(record["bytes"][k] for k in STATE_KINDS)


def moments(records):
    """Records grouped by the moment they describe (one record per role each)."""
    groups = {}
    for r in records:
        groups.setdefault(r["moment"], []).append(r)
    return list(groups.values())


@pytest.fixture(scope="module")
def six_roles(tmp_path_factory):
    """Each rank's six-role runs with free_memory on and off (one launch)."""
    from tests.conftest import run_workers

    return run_workers(tmp_path_factory.mktemp("six_roles"), 2, "ems_six_roles", "on", "off")


def test_with_free_memory_only_the_active_role_is_resident(six_roles):
    import json

    for rank_result in (found.runs["on"] for found in six_roles):
        records = rank_result.records
        with open(rank_result.path) as f:
            assert [json.loads(line) for line in f] == records
        full = rank_result.full_bytes
        assert {r["role"] for r in records} == set(full) and len(full) == 6
        for moment in moments(records):
            assert len(moment) == 6
            other = sum(r["bytes"]["other"] for r in moment)
            assert other <= OTHER_CONSTANT_BYTES
            event, active = moment[0]["event"], moment[0]["active_role"]
            for r in moment:
                if event == "onload" and r["role"] == active:
                    expected = dict(full[active])
                    if r["iteration"] == 0:  # Adam's state is created by the first step
                        expected[OPTIMIZER_STATE] = 0
                    # Inference needs weights only; training needs every kind.
                    assert {k: r["bytes"][k] for k in STATE_KINDS} == {k: expected[k] for k in STATE_KINDS}
                else:
                    assert state_bytes(r) == 0, (event, active, r["role"], r["bytes"])
            total = sum(state_bytes(r) for r in moment)
            if event == "onload" and moment[0]["iteration"] == 1:
                assert total == state_bytes({"bytes": full[active]})
        peak = max(sum(state_bytes(r) + r["bytes"]["other"] for r in m) for m in moments(records))
        assert rank_result.peak == peak == max(state_bytes({"bytes": b}) for b in full.values()) + \
            sum(r["bytes"]["other"] for r in moments(records)[0])
        # Roles that only run inference copied their weights to the host once, when built (offloaded
        # at birth): every later offload only freed them.
        for name in ("policy", "reference", "reward", "value"):
            copied = {r["host_copied_bytes"] for r in records if r["role"] == name}
            assert copied == {full[name][WEIGHTS]}, (name, copied)
        # Trainable roles really carried every kind while training.
        for name in ("ppo_policy", "ppo_value"):
            assert all(full[name][k] > 0 for k in (WEIGHTS, GRADS, OPTIMIZER_STATE)), full[name]


def test_without_free_memory_every_role_stays_resident(six_roles):
    for rank_result in (found.runs["off"] for found in six_roles):
        full = rank_result.full_bytes
        expected_total = sum(state_bytes({"bytes": b}) for b in full.values())
        after_training = [m for m in moments(rank_result.records) if m[0]["iteration"] == 1]
        for moment in after_training:
            assert sum(state_bytes(r) for r in moment) == expected_total
            for r in moment:
                assert r["bytes"][WEIGHTS] == full[r["role"]][WEIGHTS] > 0
