"""What a stage says to the one run loop (run_loop.py): what one of its steps does and which roles
it trains. Everything else of a run (process groups, ``free_memory: auto``, the overlap budget,
resume with the random state, intervals, validation, saves, the non-finite policy, a collective's
time-out named by phase) is the loop's, written once for every stage."""

from __future__ import annotations

from typing import Dict, List


class Steps:
    """A stage's steps. ``role_set``: its roles (roles.RoleSet: built, tracked by the ledger, moved
    by EMS, where each rank is); ``iteration``: the steps done; ``total``: the run's steps;
    ``label``: the progress bar's name; ``noun`` and ``unit``: a step's name, in words and in the
    printed lines;
    ``validates``: whether it has validation rows; ``validates_after_last``: whether the last step
    is validated whatever the interval (what its checkpoint records); ``samples``: a few rows of
    the latest step to keep (samples.jsonl), if it has any."""

    label: str
    noun: str = "step"
    unit: str = "step"
    total: int
    iteration: int = 0
    validates: bool = False
    validates_after_last: bool = False
    samples: list = []

    @classmethod
    def for_run(cls, prepared, ledger, progress_dir: str, overlap_budget) -> "Steps":
        """Built for a run of ``prepared`` (startup.Prepared): its roles tracked by ``ledger``,
        where each rank is recorded under ``progress_dir``, onloads overlapped within
        ``overlap_budget`` (None: not overlapped)."""
        raise NotImplementedError

    def step(self, iteration: int) -> Dict[str, float]:
        """Run step ``iteration`` (the next one); its metrics, the same on every rank."""
        raise NotImplementedError

    def validate(self) -> Dict[str, float]:
        """Validation's metrics (``val/``) of the current weights, nothing trained."""
        raise NotImplementedError

    def state_dict(self) -> Dict:
        """What the next step depends on beside the trained roles and the random state (plain
        types and tensors: a checkpoint loads it with ``weights_only``)."""
        return {}

    def load_state_dict(self, state: Dict, iteration: int) -> None:
        """Continue after step ``iteration`` from ``state`` (the trained roles already restored)."""
        self.iteration = iteration

    def recorded_scores(self) -> Dict[str, dict]:
        """role -> the score statistics its checkpoint records (a reward model's); none by default."""
        return {}

    def line(self, metrics: Dict[str, float]) -> List[str]:
        """A step's printed figures (validation's included when it ran)."""
        raise NotImplementedError

    def validation_line(self, metrics: Dict[str, float]) -> List[str]:
        """Validation's printed figures."""
        return [f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("val/") and isinstance(v, float)]

    def summary(self, history: List[Dict[str, float]], seconds: float, validations: List[Dict[str, float]]) -> List[str]:
        """The lines printed at the end of the run."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the steps started (worker processes)."""
