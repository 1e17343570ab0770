import pytest
import torch

from megatron_rlhf.memory import GRADS, MAIN_PARAMS, OPTIMIZER_STATE, WEIGHTS


def assert_same(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def test_training_with_full_offload_between_steps_is_bit_identical(workers):
    results = workers(2, "ems_bitexact")
    for rank_result in results:
        assert len(rank_result) == 8
        for key, runs in rank_result.items():
            off, on = runs["off"], runs["on"]
            assert off["losses"] == on["losses"], key
            assert_same(off["params"], on["params"], f"{key} params")
            assert_same(off["state"], on["state"], f"{key} optimizer state")
            assert off["state"], f"{key}: optimizer state is empty; nothing was compared"
            # Between steps every kind really was off the device.
            for moved in on["moved"]:
                assert moved == {GRADS: 0, MAIN_PARAMS: 0, OPTIMIZER_STATE: 0, WEIGHTS: 0}, key
            bf16 = "bf16" in key
            assert (on["resident"][MAIN_PARAMS] > 0) == bf16, key
            assert on["resident"][OPTIMIZER_STATE] > 0 and on["resident"][GRADS] > 0
