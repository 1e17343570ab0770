"""What a sandboxed call returns, whatever the code did and wherever it ran."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """status: ok | error (the code raised or exited non-zero) | timeout | output_limit | killed
    (a signal: the CPU or memory limit) | unavailable (the sandbox could not run it); output: what
    it printed (cut), with the reason appended."""

    status: str
    output: str
    seconds: float
