"""On a CUDA machine (skipped elsewhere, with the reason): bf16 on the GPU against fp32 on the CPU,
EMS bit-exact on CUDA, device memory (allocated and reserved) back after every offload, and the
six-role colocation peak. Workers of these tests run with MEGATRON_RLHF_DEVICE=cuda (ON_GPU)."""

import sys

import pytest
import torch

from tests.conftest import ON_GPU
from tests.test_ems import assert_full_offload_is_bit_identical

MiB = 2**20
# bf16 against fp32 (a 4-layer, 256-hidden model from the same weights): per-token log-probs within
# LOG_PROB_TOLERANCE, training losses within LOSS_RTOL of each other; a greedy row may leave the
# fp32 row only where fp32's top two tokens were within TIE_MARGIN (bf16's rounding can swap a tie).
LOG_PROB_TOLERANCE = 0.05
LOSS_RTOL = 0.01
TIE_MARGIN = 0.03


@pytest.mark.gpu
def test_bf16_training_and_generation_on_cuda_agree_with_fp32_on_cpu(workers, tmp_path):
    cpu = workers(1, "gpu_vs_cpu", env={"MEGATRON_RLHF_DEVICE": "cpu"})[0]
    gpu = workers(1, "gpu_vs_cpu", str(tmp_path / "gpu_vs_cpu_1" / "rank0.pt"), env=ON_GPU)[0]
    assert (cpu.device, cpu.precision, gpu.device, gpu.precision) == ("cpu", "fp32", "cuda", "bf16")
    gap = (gpu.token_log_probs - cpu.token_log_probs).abs()
    print(f"log-prob gap: max {gap.max():.4f}, mean {gap.mean():.5f}; losses cpu {cpu.losses} gpu {gpu.losses}")
    assert gap.max() <= LOG_PROB_TOLERANCE
    for a, b in zip(cpu.losses, gpu.losses):
        assert abs(a - b) <= LOSS_RTOL * abs(a)
    for row, (ours, theirs) in enumerate(zip(gpu.greedy, cpu.greedy)):
        differs = (ours != theirs).nonzero()
        if len(differs):
            first = differs[0].item()
            assert cpu.margins[row, first] <= TIE_MARGIN, (
                f"row {row}: bf16 left fp32's greedy path at token {first}, where fp32's choice led by "
                f"{cpu.margins[row, first]:.4f} (more than a tie)")


@pytest.mark.gpu
def test_ems_round_trips_are_bit_exact_on_cuda(workers):
    assert_full_offload_is_bit_identical(workers(1, "ems_bitexact", env=ON_GPU), layouts=1)


@pytest.mark.gpu
def test_after_every_offload_allocated_and_reserved_bytes_return_to_their_level(workers):
    r = workers(1, "ems_gpu", env=ON_GPU)[0]
    assert r.pinned and all(r.pinned)
    for i, rnd in enumerate(r.rounds):
        (alloc0, reserved0), (alloc1, _), (alloc2, reserved2) = rnd.before, rnd.during, rnd.after
        print(f"round {i}: allocated {alloc0 / MiB:.1f} -> {alloc1 / MiB:.1f} -> {alloc2 / MiB:.1f} MiB, "
              f"reserved {reserved0 / MiB:.1f} -> {reserved2 / MiB:.1f} MiB (state {rnd.state / MiB:.1f} MiB)")
    for rnd in r.rounds:
        (alloc0, reserved0), (alloc1, _), (alloc2, reserved2) = rnd.before, rnd.during, rnd.after
        assert alloc1 - alloc0 >= rnd.state > 100 * MiB
        # A first round may leave megatron's small lazily built tensors (under 1 MiB); the allocator
        # keeps at most one 2 MiB small-block segment for them.
        assert alloc2 - alloc0 <= MiB and reserved2 - reserved0 <= 2 * MiB, rnd
    # From the second round on, nothing at all grows.
    assert r.rounds[1].after == r.rounds[2].after == r.rounds[2].before


@pytest.mark.gpu
def test_six_roles_peak_is_the_largest_phase_not_the_sum(workers):
    r = workers(1, "ems_six_roles_gpu", env=ON_GPU)[0]
    on, off = r.on, r.off
    total_state = sum(off.full_state.values())
    transient = {p.role: p.peak - p.onloaded for p in off.phases}
    for p in on.phases:
        print(f"{p.role:<11} before onload {p.start / MiB:7.1f}  state {p.state / MiB:7.1f}  "
              f"onloaded {p.onloaded / MiB:7.1f}  peak {p.peak / MiB:7.1f} MiB (transient {transient[p.role] / MiB:.1f}); "
              f"the onload requested {p.requested} bytes for {p.state} of state")
    for p in on.phases:
        assert p.start <= MiB, p  # every role off the device before each phase
        assert abs(p.requested - p.state) <= 64 * 1024, p  # the onload brought exactly its state
    peak_on, peak_off = (max(p.peak for p in run.phases) for run in (on, off))
    # A phase's level: its state as the allocator counts it (blocks a little over the requests) and
    # the transient of its work.
    largest_phase = max(p.onloaded - p.start + transient[p.role] for p in on.phases)
    print(f"peak with EMS {peak_on / MiB:.1f} MiB (largest onloaded state + transient {largest_phase / MiB:.1f}); "
          f"without {peak_off / MiB:.1f} MiB (sum of states {total_state / MiB:.1f})")
    assert peak_on <= largest_phase + 2 * MiB
    assert peak_off >= total_state > peak_on


def test_the_kit_runs_its_steps_on_cpu_and_names_an_unknown_step(tmp_path):
    import os
    import subprocess

    from tests.conftest import REPO

    def kit(*steps):
        env = dict(os.environ, MEGATRON_RLHF_DEVICE="cpu", OUT=str(tmp_path), PYTHON=sys.executable)
        return subprocess.run(["bash", "bench/gpu/run.sh", *steps], cwd=REPO, env=env, capture_output=True, text=True)

    ran = kit("env", "tests")
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "platform cpu" in (tmp_path / "env.log").read_text()
    assert "skipped" in (tmp_path / "tests.log").read_text()  # the gpu tests, each with its reason
    assert [line.split(":")[0] for line in (tmp_path / "steps.txt").read_text().splitlines()] == ["env", "tests"]
    unknown = kit("benchmarks")
    assert unknown.returncode == 2 and "unknown step benchmarks (steps: setup env tests" in unknown.stdout


class StandInCudart:
    """torch.cuda.cudart()'s page-locking calls, recorded (a CPU machine has no driver)."""

    def __init__(self):
        self.pinned, self.calls = {}, []

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append(("register", address))
        overlaps = any(a < address + nbytes and address < a + n for a, n in self.pinned.items())
        self.pinned[address] = nbytes
        return 712 if overlaps else 0  # cudaErrorHostMemoryAlreadyRegistered, as the driver answers

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return 0 if self.pinned.pop(address, None) is not None else 713


def test_cuda_host_arenas_own_their_pages_and_are_unpinned_once_however_they_go(monkeypatch):
    """The pinned arenas EMS copies through: each on pages of its own (the driver pins whole
    pages), unpinned exactly once whether released or dropped with its role, and a failed call
    named rather than left for an unrelated kernel to report."""
    import gc
    import mmap

    from megatron_rlhf.runtime.platform import CudaPlatform

    cudart = StandInCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    platform = object.__new__(CudaPlatform)  # no device to bind on CPU
    platform._registered, platform._side = {}, None
    monkeypatch.setattr(platform, "synchronize", lambda: None)
    sizes = (1, 100, mmap.PAGESIZE + 1, 3 * 2**20 + 5)
    arenas = [platform.host_arena(n) for n in sizes]
    assert [a.numel() for a in arenas] == list(sizes)
    assert all(a.data_ptr() % mmap.PAGESIZE == 0 for a in arenas)
    assert all(code == "register" for code, _ in cudart.calls) and len(cudart.pinned) == len(sizes)
    arenas[0].fill_(7)
    assert arenas[0].tolist() == [7]
    platform.release_host_arena(arenas[0])
    platform.release_host_arena(arenas[0])  # a second release does nothing
    dropped = arenas[1].data_ptr()
    del arenas[:2]
    gc.collect()
    assert ("unregister", dropped) in cudart.calls and len(cudart.pinned) == len(sizes) - 2
    assert sum(code == "unregister" for code, _ in cudart.calls) == 2
    # What the driver refuses is said at the call that failed, naming it.
    cudart.pinned.pop(arenas[0].data_ptr())
    with pytest.raises(RuntimeError, match="cudaHostUnregister of the arena at 0x[0-9a-f]+ failed: CUDA error 713"):
        platform.release_host_arena(arenas[0])
    cudart.cudaHostRegister = lambda address, nbytes, flags: 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 64 host bytes failed: CUDA error 2; .*\(ulimit -l\)"):
        platform.host_arena(64)


@pytest.mark.gpu
def test_decode_steps_replayed_from_cuda_graphs_give_the_eager_tokens_and_log_probs_bit_for_bit(workers):
    r = workers(1, "decode_graphs_gpu", env=ON_GPU)[0]
    for name, (tokens, log_probs, replays) in r.graphed.items():
        eager_tokens, eager_log_probs, eager_replays = r.eager[name]
        print(f"{name}: {replays} decode steps replayed")
        assert replays > 0 and eager_replays == 0, name
        assert torch.equal(tokens, eager_tokens), name
        assert torch.equal(log_probs, eager_log_probs), name
    print(f"the libraries' workspaces for the capture stream, taken before: {r.capture_stream_workspaces / MiB:.1f} MiB; "
          f"the first runs kept {r.first_runs_kept} bytes")
    before, after = r.allocated_after
    assert after == before, f"the graphs' memory was not given back: {(after - before) / MiB:.1f} MiB"
