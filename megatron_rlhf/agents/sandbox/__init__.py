"""A sandboxed Python tool for model-written code (``megatron_rlhf.agents.sandbox:python``).

Where the code runs is ``rollout.sandbox.kind`` (config/schema.py SandboxConfig), one of SANDBOXES:
- ``isolated`` (the default): a fresh interpreter per call inside the kernel's walls, made by
  bubblewrap (isolation.py: namespaces, a read-only view of the interpreter only, a
  bounded tmpfs as its directory, no network, no capability, seccomp); nothing of the host's files,
  processes or network is in reach, and nothing it starts outlives the call.
- ``remote``: a SandboxFusion service (remote.py), for clusters whose containers
  cannot make namespaces.
- ``unsafe_process``: a fresh interpreter in its own session and temporary directory under an audit
  hook and resource limits only (no isolation: said at start-up and counted in the metrics).
A machine that cannot make the walls refuses the run before start-up (``readiness_problem``); a
call never falls back to a weaker kind. Standard output and error come back together, cut at
``output_bytes``; whatever the code does, the call returns a ``SandboxResult`` and the rollout goes on.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import threading
from typing import Callable, Dict, Optional

from megatron_rlhf.config.names import SANDBOX_KINDS, registry
from megatron_rlhf.config.schema import SandboxConfig
from megatron_rlhf.agents.function import ToolError
from megatron_rlhf.agents.sandbox import isolation
from megatron_rlhf.agents.sandbox.local import run_local
from megatron_rlhf.agents.sandbox.result import SandboxResult

_settings = SandboxConfig()
_unsafe_runs = [0]
_lock = threading.Lock()


def configure(settings: SandboxConfig) -> None:
    """This process's sandbox (the environment workers': rollout.sandbox); its count of unsafe
    calls starts again."""
    global _settings
    _settings = settings
    take_unsafe_runs()


def take_unsafe_runs() -> int:
    """Calls run without isolation since the last call (rollout/tool_unsafe_calls)."""
    with _lock:
        runs, _unsafe_runs[0] = _unsafe_runs[0], 0
    return runs


def run_python(code: str, settings: Optional[SandboxConfig] = None) -> SandboxResult:
    """Run ``code`` in the sandbox ``settings`` (default: this process's); never raises for what
    the code does."""
    settings = settings or _settings
    return SANDBOXES[settings.kind](code, settings)


def _boot_settings(settings: SandboxConfig, walled: bool) -> str:
    """The boot's settings: the limits, and with ``walled`` what it needs inside bubblewrap."""
    values = {**dataclasses.asdict(settings), "walled": walled, "library": isolation.library_paths()}
    if walled:
        values.update(workdir=isolation.WORKDIR, uid=isolation.call_uid(), seccomp=isolation.seccomp_program().hex())
    return json.dumps(values)


def _run_isolated(code: str, settings: SandboxConfig) -> SandboxResult:
    missing = isolation.missing_parts()
    if missing:
        return SandboxResult("unavailable", f"the sandbox cannot run code here: {missing}", 0.0)
    return run_local(isolation.bwrap_command(_boot_settings(settings, True)), "/", code, settings)


def _run_unsafe_process(code: str, settings: SandboxConfig) -> SandboxResult:
    with _lock:
        _unsafe_runs[0] += 1
    home = tempfile.mkdtemp(prefix="sandbox-")
    try:
        command = [sys.executable, "-I", "-S", "-B", isolation.BOOT, _boot_settings(settings, False)]
        return run_local(command, home, code, settings)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _run_remote(code: str, settings: SandboxConfig) -> SandboxResult:
    from megatron_rlhf.agents.sandbox.remote import run_remote

    return run_remote(code, settings)


SANDBOXES: Dict[str, Callable[[str, SandboxConfig], SandboxResult]] = registry(
    SANDBOX_KINDS, "rollout.sandbox.kind",
    {"isolated": _run_isolated, "remote": _run_remote, "unsafe_process": _run_unsafe_process})


REMOTE_TRIAL_S = 5.0  # the start-up trial call's run time-out on a remote sandbox (one try)


def readiness_problem(settings: SandboxConfig) -> Optional[str]:
    """Why calls of ``settings``'s kind cannot run on this machine (a trial call), or None."""
    if settings.unsafe:
        return None
    missing = None if settings.remote else isolation.missing_parts()
    if missing:
        return missing
    # A local sandbox's first call may wait for the page cache; a service answers at once or not
    # at all: one try, its own short time-out (a service that never answers is refused in seconds).
    trial_settings = dataclasses.replace(settings, wall_s=REMOTE_TRIAL_S, retries=0) if settings.remote else \
        dataclasses.replace(settings, wall_s=max(settings.wall_s, 30.0))
    trial = run_python("print(6 * 7)", trial_settings)
    if trial.status == "ok" and trial.output == "42\n":
        return None
    said = " ".join(trial.output.split())[-300:] or trial.status
    if settings.remote:
        return f"a trial call to {settings.url} failed ({said})"
    return f"bubblewrap cannot make the sandbox's namespaces here ({said})"


def uses_sandbox(tools) -> bool:
    """Whether one of ``tools`` (FunctionTools) runs code here: this module's ``python``, or a
    tool of a module that imports this module or ``run_python``."""
    mine = sys.modules[__name__]
    for tool in tools:
        module = sys.modules.get(getattr(tool.fn, "__module__", None) or "")
        if module is mine or (module is not None and any(v is mine or v is run_python for v in vars(module).values())):
            return True
    return False


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: The Python program to run; print the values you want to see.
    """
    result = run_python(code)
    if result.status == "ok":
        return result.output or "(no output)"
    raise ToolError(result.output.strip() or f"the code failed ({result.status})", timed_out=result.status == "timeout")
