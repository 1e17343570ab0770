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
from megatron_rlhf.agents.sandbox.isolation import INSIDE_ENVIRONMENT
from megatron_rlhf.agents.sandbox.result import SandboxResult

SETUP_FAILED = 125  # boot.SETUP_FAILED (not imported: the boot runs bare, inside the walls)


def run_local(command: List[str], cwd: str, code: str, settings: SandboxConfig) -> SandboxResult:
    started = time.perf_counter()
    try:
        process = subprocess.Popen(command, cwd=cwd, env=INSIDE_ENVIRONMENT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
    # poll, not select: a trainer holds many descriptors (process groups, files), and select
    # refuses any numbered 1024 or more.
    waiting = select.poll()
    waiting.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        if not waiting.poll(1000 * min(left, 0.5)):
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
        return "killed", output + f"\n[stopped by {name}: {_why_stopped(name, limits)}]"
    return ("ok" if code == 0 else "error"), output


def _why_stopped(signal_name: str, limits: SandboxConfig) -> str:
    """What a signal that ended the code means here: the CPU-time limit sends SIGXCPU, then SIGKILL
    at the hard limit; a failed allocation in C code past the address-space limit ends in SIGSEGV
    or SIGABRT; a system call the filter kills (another ABI's) in SIGSYS."""
    if signal_name in ("SIGXCPU", "SIGKILL"):
        return f"the CPU-time limit ({limits.cpu_s:g}s)"
    if signal_name in ("SIGSEGV", "SIGBUS", "SIGABRT"):
        return f"a crash, most often the memory limit ({limits.memory_mb} MB) reached in C code"
    if signal_name == "SIGSYS":
        return "a system call the sandbox does not allow"
    return "a signal the code did not handle"


def _wait(process: subprocess.Popen, seconds: float) -> Optional[int]:
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _kill_session(process: subprocess.Popen) -> None:
    """Kill the call's session: the interpreter (or bubblewrap, whose namespace dies with it) and
    anything left running, and return once none of them runs. The processes inside bubblewrap's
    session of their own are killed by name too: the namespace's end reaches them only after
    bubblewrap has gone, a moment later."""
    inside = _descendants(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in inside:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _wait(process, 5.0)
    deadline = time.monotonic() + 5.0
    while any(_running(pid) for pid in inside) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.stdout.close()


def _descendants(root: int) -> List[int]:
    """The processes below ``root`` (from /proc: each process's parent)."""
    parents = {int(name): int(fields[1]) for name in os.listdir("/proc")
               if name.isdigit() and (fields := _stat(int(name)))}
    found, frontier = [], [root]
    while frontier:
        below = [pid for pid, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, already dead, does not)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != b"Z"


def _stat(pid: int) -> List[bytes]:
    """/proc/<pid>/stat's fields after the command name (state, parent, ...); [] once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []
