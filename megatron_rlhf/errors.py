"""Faults a run reports as one line, without a traceback (train.main catches them): the user's
input or the run's numbers went wrong, not the program. ConfigError (config/errors.py) and
CheckpointError (checkpoint/model_files.py) are the others. Also what else a front end shows:
``hide_internal_warnings``."""

import os
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PYTHONS_FORMAT = warnings.formatwarning


class RunError(RuntimeError):
    """A fault found while the run is going, named with the iteration and what to do.
    ``collective``: every rank found it together (so one rank reports it for all)."""

    def __init__(self, message: str, collective: bool = False):
        super().__init__(message)
        self.collective = collective


class NonFiniteError(RunError):
    """A loss, gradient, reward or weight that is NaN or infinite (or beyond its bound)."""


class NoGradientError(RunError):
    """A training pass whose output needs no gradient: the trained parameters before it would never learn."""


class RewardFunctionError(RunError):
    """A reward function that failed or broke its contract (one finite number per response)."""


def hide_internal_warnings() -> None:
    """megatron-core and torch warn about fallbacks in their own internals (transformer-engine or
    Apex not installed, ...): hidden unless MEGATRON_RLHF_WARNINGS=1; the project's own always show,
    each as one line of ours (``warning: ...``), not Python's file, line, category and source line."""
    warnings.formatwarning = _ours_as_one_line
    if os.environ.get("MEGATRON_RLHF_WARNINGS"):
        return
    for module in ("megatron", "torch", "transformer_engine", "apex"):  # a regex: not megatron_rlhf
        warnings.filterwarnings("ignore", module=rf"{module}(\.|$)")
    # Warnings of torch's and megatron's internals raised where their calls pass the CPU adaptation's
    # function mode (it warns nothing of its own).
    warnings.filterwarnings("ignore", module=r"megatron_rlhf\.runtime\.megatron_cpu$")


def _ours_as_one_line(message, category, filename, lineno, line=None) -> str:
    if os.path.abspath(filename).startswith(_PACKAGE):
        return f"warning: {message}\n"
    return _PYTHONS_FORMAT(message, category, filename, lineno, line)
