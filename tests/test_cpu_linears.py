"""The generation engine's CPU linears (runtime/cpu_linears.py): oneDNN on packed weights."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.runtime import cpu_linears

pytestmark = pytest.mark.skipif(not cpu_linears.onednn_available(), reason="torch built without oneDNN")


@pytest.fixture
def every_weight_packed(monkeypatch):
    monkeypatch.setattr(cpu_linears, "SMALLEST_PACKED_WEIGHT", 0)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 0.0)])
def test_a_packed_product_agrees_with_f_linear_to_rounding(every_weight_packed, dtype, atol):
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(shape, generator=g).to(dtype) for shape in ((7, 1, 64), (96, 64), (96,)))
    packed = cpu_linears.PackedWeights()
    for b in (None, bias):
        got, expected = packed.matmul(x, weight, b), F.linear(x, weight, b)
        assert got.shape == (7, 1, 96) and got.dtype == dtype
        assert torch.allclose(got.float(), expected.float(), rtol=0, atol=atol * expected.abs().max().item())


def test_a_row_s_product_does_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(40, 256, generator=g), torch.randn(768, 256, generator=g)
    packed = cpu_linears.PackedWeights()
    everything = packed.matmul(x, weight, None)
    for rows in (1, 3, 16, 17):
        assert torch.equal(packed.matmul(x[:rows], weight, None), everything[:rows]), rows


def test_each_weight_is_packed_once_and_small_ones_run_f_linear(every_weight_packed, monkeypatch):
    reorders = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(cpu_linears, "pack", lambda w: reorders.append(w) or reorder(w))
    packed, x = cpu_linears.PackedWeights(), torch.randn(2, 8)
    weight = torch.randn(4, 8)
    for _ in range(3):
        packed.matmul(x, weight, None)
    assert len(reorders) == 1
    other = torch.randn(4, 8)
    assert torch.allclose(packed.matmul(x, other, None), F.linear(x, other), atol=1e-5) and len(reorders) == 2
    monkeypatch.setattr(cpu_linears, "SMALLEST_PACKED_WEIGHT", other.numel() + 1)
    small = torch.randn(4, 8)
    assert torch.equal(packed.matmul(x, small, None), F.linear(x, small)) and len(reorders) == 2


def test_dtypes_onednn_does_not_pack_run_f_linear():
    x, weight = torch.randn(3, 8, dtype=torch.float16), torch.randn(5, 8, dtype=torch.float16)
    assert torch.equal(cpu_linears.PackedWeights().matmul(x, weight, None), F.linear(x, weight))


def test_a_dtype_this_cpu_cannot_pack_runs_f_linear(every_weight_packed, monkeypatch):
    """oneDNN's bf16 reorder raises on CPUs without AVX-512 or AVX-NE-CONVERT (the project's AMD VMs):
    the probe finds it once, and the engine's and the batch-invariant mode's products run F.linear."""
    def no_bf16(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(cpu_linears, "_packs", {})
    monkeypatch.setattr(cpu_linears, "pack", no_bf16)
    x, weight = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    assert torch.equal(cpu_linears.PackedWeights().matmul(x, weight, None), F.linear(x, weight))
    assert cpu_linears._packs == {torch.bfloat16: False}
    from megatron_rlhf.models import batch_invariant
    assert not batch_invariant._onednn_for(x, weight)


def test_the_kernel_is_chosen_by_the_environment_and_a_bad_choice_is_refused_by_name(monkeypatch):
    monkeypatch.delenv(cpu_linears.KERNEL_VARIABLE, raising=False)
    assert cpu_linears.chosen_kernel() == "onednn"
    monkeypatch.setenv(cpu_linears.KERNEL_VARIABLE, " Torch ")
    assert cpu_linears.chosen_kernel() == "torch"
    monkeypatch.setenv(cpu_linears.KERNEL_VARIABLE, "mkl")
    with pytest.raises(cpu_linears.LinearKernelChoiceError, match=r"MEGATRON_RLHF_CPU_LINEARS='mkl': must be one of onednn, torch"):
        cpu_linears.chosen_kernel()
    monkeypatch.setenv(cpu_linears.KERNEL_VARIABLE, "onednn")
    monkeypatch.setattr(cpu_linears, "onednn_available", lambda: False)
    with pytest.raises(cpu_linears.LinearKernelChoiceError, match="built without oneDNN"):
        cpu_linears.chosen_kernel()
