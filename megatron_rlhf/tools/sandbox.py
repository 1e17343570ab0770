"""A sandboxed Python tool for model-written code (``megatron_rlhf.tools.sandbox:python``).

Each call runs the code in a fresh interpreter (tools/sandbox_boot.py): its own temporary
directory (deleted after), an empty environment, a session of its own (every process it leaves
is killed after), limits on CPU time, wall time, memory, file size and processes, no network
where the kernel allows a network namespace, and an audit hook that refuses reading anything
outside its directory and the Python library, writing outside its directory, sockets, new
processes, signals and ctypes. Standard output and error come back together, cut at
``output_bytes``. Whatever the code does, the call returns a ``SandboxResult``; the rollout goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Optional

from megatron_rlhf.tools.function import ToolError

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_s: float = 10.0
    wall_s: float = 20.0
    memory_mb: int = 1024
    file_mb: int = 16
    output_bytes: int = 8192
    network_namespace: bool = True  # when the kernel allows one; the audit hook refuses sockets anyway


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """status: ok | error (the code raised or exited non-zero) | timeout | output_limit | killed
    (a signal: the CPU or memory limit); output: what it printed (cut), with the reason appended."""

    status: str
    output: str
    seconds: float


@functools.lru_cache(maxsize=None)
def _library() -> tuple:
    """The directories the code may read and import from: the standard library and the
    interpreter's installed packages (not editable installs elsewhere: their paths are not here)."""
    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)]
    found += [p for p in sys.path if p.endswith("lib-dynload")]  # the standard library's extension modules
    return tuple(sorted({os.path.realpath(p) for p in found if os.path.isdir(p)}))


def network_namespace_available() -> bool:
    """Whether a sandboxed process can leave the host's network (a network namespace, as root or
    through a user namespace); where it cannot, only the audit hook stands between code and sockets."""
    probe = ("import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "sys.exit(0 if libc.unshare(0x40000000) == 0 or libc.unshare(0x50000000) == 0 else 1)")
    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", probe], timeout=30, env={}).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` in the sandbox; never raises for what the code does."""
    home = tempfile.mkdtemp(prefix="sandbox-")
    settings = {**dataclasses.asdict(limits), "library": list(_library())}
    started = time.perf_counter()
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HOME": home}
    try:
        process = subprocess.Popen([sys.executable, "-I", "-S", "-B", BOOT, json.dumps(settings)], cwd=home, env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    except OSError as e:
        shutil.rmtree(home, ignore_errors=True)
        return SandboxResult("error", f"the sandbox could not start: {e}", 0.0)
    try:
        status, output = _communicate(process, code, limits)
    finally:
        _kill_session(process)
        shutil.rmtree(home, ignore_errors=True)
    return SandboxResult(status, output, time.perf_counter() - started)


def _communicate(process: subprocess.Popen, code: str, limits: SandboxLimits):
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
    code_ = _wait(process, 2.0)
    if code_ is None or code_ < 0:
        name = signal.Signals(-code_).name if code_ is not None and code_ < 0 else "no exit"
        return "killed", output + f"\n[stopped by {name}: the CPU-time ({limits.cpu_s:g}s) or memory " \
                                  f"({limits.memory_mb} MB) limit]"
    return ("ok" if code_ == 0 else "error"), output


def _wait(process: subprocess.Popen, seconds: float) -> Optional[int]:
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _kill_session(process: subprocess.Popen) -> None:
    """Kill the code's session: the interpreter and anything it left running."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _wait(process, 5.0)
    process.stdout.close()


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: The Python program to run; print the values you want to see.
    """
    result = run_python(code)
    if result.status == "ok":
        return result.output or "(no output)"
    raise ToolError(result.output.strip() or f"the code failed ({result.status})", timed_out=result.status == "timeout")
