"""A sandboxed call on this machine: the interpreter (inside bubblewrap, or a bare process for
unsafe_process) started in a session of its own, fed the code, read up to the output and wall-time
limits, and its session killed after, whatever happened."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from typing import List, Optional

from megatron_rlhf.config.schema import SandboxConfig
from megatron_rlhf.agents.sandbox.result import SandboxResult

SETUP_FAILED = 125  # boot.SETUP_FAILED (not imported: the boot runs bare, inside the walls)


def run_local(command: List[str], cwd: str, code: str, settings: SandboxConfig) -> SandboxResult:
    started = time.perf_counter()
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        return SandboxResult("unavailable", f"the sandbox could not start: {e}", 0.0)
    try:
        status, output = _communicate(process, code, settings)
    finally:
        _kill_session(process)
    return SandboxResult(status, output, time.perf_counter() - started)


def _communicate(process: subprocess.Popen, code: str, limits: SandboxConfig):
    """Feed the code, read the output up to its limit and the wall time; (status, output)."""
    try:
        process.stdin.write(code.encode())
        process.stdin.close()
    except BrokenPipeError:
        pass
    deadline = time.monotonic() + limits.wall_s
    chunks, size, status = [], 0, None
    fd = process.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > limits.output_bytes:
            status = "output_limit"
            break
    output = b"".join(chunks)[: limits.output_bytes].decode(errors="replace")
    if status == "timeout":
        return status, output + f"\n[stopped: it ran past the wall-time limit of {limits.wall_s:g}s]"
    if status == "output_limit":
        return status, output + f"\n[stopped: it printed more than {limits.output_bytes} bytes]"
    return _exit_status(_wait(process, 2.0), output, limits)


def _exit_status(code: Optional[int], output: str, limits: SandboxConfig):
    """(status, output) of an ended process: bubblewrap reports a signal as 128 + its number."""
    if code == SETUP_FAILED:
        return "unavailable", output
    signalled = code is None or code < 0 or code > 128
    if signalled:
        number = -code if code is not None and code < 0 else (code - 128 if code is not None else None)
        name = signal.Signals(number).name if number in signal.valid_signals() else "no exit"
        return "killed", output + f"\n[stopped by {name}: the CPU-time ({limits.cpu_s:g}s) or memory " \
                                  f"({limits.memory_mb} MB) limit]"
    return ("ok" if code == 0 else "error"), output


def _wait(process: subprocess.Popen, seconds: float) -> Optional[int]:
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _kill_session(process: subprocess.Popen) -> None:
    """Kill the call's session: the interpreter (or bubblewrap, whose namespace dies with it) and
    anything left running."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _wait(process, 5.0)
    process.stdout.close()
