"""The remote sandbox (``rollout.sandbox.kind: remote``): model-written code run by a SandboxFusion
service (``POST {url}/run_code``, the service verl's and ROLL's users run), for clusters whose
training containers cannot make namespaces.

At most ``max_concurrent_calls`` calls of a worker are in flight; each is bounded by ``wall_s``
(the service's run time-out, and this side's wait a little beyond it). A connection that fails
(refused, reset, timed out, or a 5xx/429 answer) is tried again ``retries`` times with a growing
pause; a call that still fails is answered to the model as the sandbox being unavailable (counted
as a tool error), never the trajectory's or the run's failure. The result is the local sandbox's
``SandboxResult``.
"""

from __future__ import annotations

import functools
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict

from megatron_rlhf.config.schema import SandboxConfig
from megatron_rlhf.agents.sandbox.result import SandboxResult

RETRY_PAUSE_S = 0.5  # doubled at each try
WAIT_BEYOND_S = 10.0  # this side waits the service's run time-out plus this


@functools.lru_cache(maxsize=None)
def _slots(url: str, calls: int) -> threading.BoundedSemaphore:
    return threading.BoundedSemaphore(calls)


class _Retryable(Exception):
    pass


def _post(url: str, payload: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        if e.code >= 500 or e.code == 429:
            raise _Retryable(f"HTTP {e.code} {e.reason}") from None
        raise ValueError(f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, ConnectionError, socket.timeout, http.client.HTTPException, OSError) as e:
        raise _Retryable(str(getattr(e, "reason", e))) from None
    try:  # a service that is not SandboxFusion (a proxy's page, a null) is named as such
        answer = json.loads(text)
    except ValueError:
        raise ValueError(f"its answer is not JSON (is {url} a SandboxFusion service?): {text[:80]!r}") from None
    if not isinstance(answer, dict):
        raise ValueError(f"its answer is {json.dumps(answer)[:80]}, not the JSON object SandboxFusion answers")
    return answer


def run_remote(code: str, settings: SandboxConfig) -> SandboxResult:
    url = settings.url.rstrip("/") + "/run_code"
    payload = {"code": code, "language": "python", "run_timeout": settings.wall_s, "compile_timeout": settings.wall_s,
               "memory_limit_MB": settings.memory_mb}
    started = time.perf_counter()
    failure = ""
    with _slots(settings.url, settings.max_concurrent_calls):
        for attempt in range(settings.retries + 1):
            if attempt:
                time.sleep(RETRY_PAUSE_S * 2 ** (attempt - 1))
            try:
                answer = _post(url, payload, settings.wall_s + WAIT_BEYOND_S)
            except _Retryable as e:
                failure = str(e)
                continue
            except ValueError as e:
                failure = str(e)
                break
            return _result(answer, settings, time.perf_counter() - started)
    tries = f" after {attempt + 1} tries" if attempt else ""
    return SandboxResult("unavailable", f"the remote sandbox did not run the code{tries}: {failure}",
                         time.perf_counter() - started)


def _result(answer: Dict[str, Any], settings: SandboxConfig, seconds: float) -> SandboxResult:
    """SandboxFusion's answer ({status, run_result: {status, return_code, stdout, stderr}}) as ours."""
    run = answer.get("run_result") or {}
    if answer.get("status") == "SandboxError" or not isinstance(run, dict) or not run:
        said = answer.get("message") or answer.get("status") or "no run result"
        return SandboxResult("unavailable", f"the remote sandbox failed: {str(said)[:300]}", seconds)
    output = f"{run.get('stdout') or ''}{run.get('stderr') or ''}"
    if len(output.encode()) > settings.output_bytes:
        cut = output.encode()[: settings.output_bytes].decode(errors="replace")
        return SandboxResult("output_limit", cut + f"\n[stopped: it printed more than {settings.output_bytes} bytes]",
                             seconds)
    if run.get("status") == "TimeLimitExceeded":
        return SandboxResult("timeout", output + f"\n[stopped: it ran past the wall-time limit of {settings.wall_s:g}s]",
                             seconds)
    return SandboxResult("ok" if run.get("return_code") == 0 else "error", output, seconds)
