"""Faults a run reports as one line, without a traceback (train.main catches them): the user's
input or the run's numbers went wrong, not the program. ConfigError (config/errors.py) and
CheckpointError (checkpoint/model_files.py) are the others."""


class RunError(RuntimeError):
    """A fault found while the run is going, named with the iteration and what to do.
    ``collective``: every rank found it together (so one rank reports it for all)."""

    def __init__(self, message: str, collective: bool = False):
        super().__init__(message)
        self.collective = collective


class NonFiniteError(RunError):
    """A loss, gradient, reward or weight that is NaN or infinite (or beyond its bound)."""


class RewardFunctionError(RunError):
    """A reward function that failed or broke its contract (one finite number per response)."""
