"""Rule rewards scored in worker processes, one response per call, each call with a time-out.

Each worker is handed a batch of calls at a time and answers each as it is scored (no round trip
per call); a call's time-out runs from the answer before it, so a slow call is caught on its own.

A verifier can hang on a pathological answer or a remote judge never reply; the run must not.
Every rank keeps ``num_workers`` worker processes (plain interpreters running
``megatron_rlhf.rewards.worker``: they import the reward modules only, not torch or the training
program). A call that raises, or outlives ``timeout_s`` (its worker is killed and replaced),
scores ``failure_score`` and is counted. What is a bug rather than a hard input ends the run with
one line naming the function: a result that breaks the contract, a call that exits its worker
(``sys.exit``, ``os._exit``, a crash), an iteration in which every call failed, or one whose first
calls all time out, twice per worker (a reward that blocks ends the run in 2 x timeout_s).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_rlhf.errors import NonFiniteError, RewardFunctionError

FAILED = None  # a call that raised or timed out
# Time-outs per worker, with nothing answered yet, after which a batch stops: the reward blocks.
BLOCKED_AFTER = 2


class WorkerProcess:
    """``python -m MODULE FD ARGS...``: a plain interpreter that talks over ``conn`` (a socket
    pair's end), with the task it is answering and that task's deadline (the reward and
    environment pools' workers)."""

    def __init__(self, module: str, args: Sequence[str]):
        parent, child = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", module, str(child.fileno()), *args],
                                        pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        child.close()
        self.conn = Connection(parent.detach())
        self.task = None
        self.deadline = 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class _Worker(WorkerProcess):
    def __init__(self, specs: Sequence[str]):
        super().__init__("megatron_rlhf.rewards.worker", specs)
        self.batch: List[Tuple[int, int]] = []  # (response, function) of the calls sent, not yet answered


class RewardPool:
    """``functions``: spec (a module, or an absolute file path) -> weight; the score is the
    weighted sum of each function's ``score``."""

    def __init__(self, functions: Dict[str, float], num_workers: int = 2, timeout_s: float = 30.0,
                 failure_score: float = 0.0, wait: bool = True, not_applicable_score: float = 0.0):
        """``wait``: return once every worker has loaded the functions (False: the first score()
        waits, so that the workers load them while the caller builds its models)."""
        self.specs, self.weights = list(functions), list(functions.values())
        self.timeout_s, self.failure_score = timeout_s, failure_score
        # A response no function applies to (each returned None): TRL's nansum over none, 0.
        self.not_applicable_score = not_applicable_score
        self.workers = [_Worker(self.specs) for _ in range(num_workers)]  # they load the functions at once
        self._ready = False
        if wait:
            self._wait_ready()

    def _wait_ready(self) -> None:
        if self._ready:
            return
        try:
            for worker in self.workers:
                self._await_ready(worker, ValueError)  # a function that does not load: bad input
        except BaseException:
            self.close()
            raise
        self._ready = True

    def _await_ready(self, worker: _Worker, error: type) -> None:
        """Wait until ``worker`` has loaded the functions; a load failure raises ``error``."""
        kind, message = self._receive(worker, self.timeout_s + 60.0, "loading the reward functions")
        if kind != "ready":
            raise error(message)

    def _receive(self, worker: _Worker, timeout: float, doing: str):
        if not worker.conn.poll(timeout):
            raise RewardFunctionError(f"a reward worker took over {timeout:.0f}s {doing}")
        try:
            return worker.conn.recv()
        except EOFError:
            code = worker.process.wait()
            raise RewardFunctionError(f"a reward worker ended (exit code {code}) while {doing}") from None

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []

    def _call(self, function: int, row: int, prompts: List[str]) -> Tuple[str, str]:
        """``reward function SPEC`` ... ``on response ROW (prompt ...)``: how messages name a call."""
        return f"reward function {self.specs[function]}", f"on response {row} (prompt {prompts[row]!r:.60})"

    def score(self, prompts: List[str], responses: List[str], fields: List[Dict[str, Any]]) -> Tuple[torch.Tensor, Dict[str, float]]:
        """[B] float32 scores and their metrics (``reward/failures``, ``reward/timeouts``, and the
        mean of every function's score and named sub-score when there are several or any)."""
        self._wait_ready()
        tasks = [(row, f) for row in range(len(responses)) for f in range(len(self.specs))]
        results: Dict[Tuple[int, int], Optional[Dict[str, float]]] = {}
        counts = {"failures": 0, "timeouts": 0}
        first_failure: Optional[str] = None
        timeouts_in_a_row = 0  # with no call answered in between
        pending = list(tasks)
        # Batches small enough that the workers finish together (a few per worker).
        size = max(1, -(-len(tasks) // (4 * len(self.workers))))
        while len(results) < len(tasks):
            for worker in self.workers:
                if not worker.batch and pending:
                    worker.batch, pending = pending[:size], pending[size:]
                    worker.deadline = time.monotonic() + self.timeout_s
                    worker.conn.send([(f, prompts[row], responses[row], fields[row]) for row, f in worker.batch])
            busy = [w for w in self.workers if w.batch]
            wait([w.conn for w in busy], timeout=max(0.0, min(w.deadline for w in busy) - time.monotonic()))
            for worker in busy:
                (row, f), rest = worker.batch[0], worker.batch[1:]
                if worker.conn.poll():
                    outcome = self._collect(worker, row, f, prompts)
                    worker.batch, worker.deadline = rest, time.monotonic() + self.timeout_s  # the next call's
                elif time.monotonic() >= worker.deadline:
                    outcome = ("timeout", f"took over {self.timeout_s:g}s (reward.timeout_s)")
                    self._replace(worker)  # a fresh worker, with no batch
                    pending = rest + pending  # the rest of the batch, to whichever worker is free first
                else:
                    continue
                kind, value = outcome
                timeouts_in_a_row = timeouts_in_a_row + 1 if kind == "timeout" else 0
                if kind == "ok":
                    results[row, f] = value
                    continue
                results[row, f] = FAILED
                counts["failures"] += 1
                counts["timeouts"] += kind == "timeout"
                if first_failure is None:
                    name, where = self._call(f, row, prompts)
                    first_failure = f"{name} {value} {where}"
                if timeouts_in_a_row >= BLOCKED_AFTER * len(self.workers) and len(results) == timeouts_in_a_row:
                    # Nothing answered yet and every worker timed out twice: a reward that blocks, not a slow row.
                    raise RewardFunctionError(f"the first {timeouts_in_a_row} reward calls of the batch all timed out "
                                              f"(nothing answered); the first: {first_failure}")
        if tasks and counts["failures"] == len(tasks):
            raise RewardFunctionError(f"every reward call of the batch failed; the first: {first_failure}")
        if counts["failures"]:  # scored as failure_score and counted; the reason said, not only the count
            warnings.warn(f"{counts['failures']} of {len(tasks)} reward calls failed ({counts['timeouts']} timed out) and "
                          f"scored reward.failure_score={self.failure_score:g}; the first: {first_failure}")
        return self._combine(results, len(responses)), self._metrics(results, counts, len(responses))

    def _collect(self, worker: _Worker, row: int, f: int, prompts: List[str]):
        name, where = self._call(f, row, prompts)
        try:
            kind, value = worker.conn.recv()
        except EOFError:
            code = worker.process.wait()
            raise RewardFunctionError(f"{name} ended its worker process (exit code {code}) {where}; a reward must return "
                                      "its scores, not exit") from None
        if kind in ("exit", "contract"):
            raise RewardFunctionError(f"{name} {value} {where}")
        return kind, value

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        fresh = _Worker(self.specs)
        self._await_ready(fresh, RewardFunctionError)
        worker.__dict__.update(fresh.__dict__)

    def _combine(self, results, rows: int) -> torch.Tensor:
        scores = []
        for row in range(rows):
            applied = [(weight, self.failure_score if results[row, f] is FAILED else results[row, f]["score"])
                       for f, weight in enumerate(self.weights)]
            applied = [(weight, score) for weight, score in applied if score is not None]  # None: adds nothing
            scores.append(sum(w * s for w, s in applied) if applied else self.not_applicable_score)
        return torch.tensor(scores, dtype=torch.float32)

    def _metrics(self, results, counts: Dict[str, int], rows: int) -> Dict[str, float]:
        """reward/failures, reward/timeouts; with several functions (or named sub-scores) each
        function's mean score as it went into the reward (failure_score for its failed calls:
        reported whether or not any call of it succeeded) and its own failures."""
        metrics = {f"reward/{k}": float(v) for k, v in counts.items()}
        not_applicable = sum(r is not FAILED and r["score"] is None for r in results.values())
        if not_applicable:
            metrics["reward/not_applicable"] = float(not_applicable)
        for f, spec in enumerate(self.specs):
            named: Dict[str, List[float]] = {}
            failed = sum(results[row, f] is FAILED for row in range(rows))
            for row in range(rows):
                for key, value in (results[row, f] or {}).items():
                    if value is not None:
                        named.setdefault(key, []).append(value)
            if len(self.specs) == 1 and set(named) <= {"score"}:
                continue  # reward/mean says it already
            prefix = f"reward/{spec.rpartition(':')[2]}"
            named["score"] = named.get("score", []) + [self.failure_score] * failed
            for key, values in named.items():
                if values:
                    metrics[prefix if key == "score" else f"{prefix}/{key}"] = sum(values) / len(values)
            metrics[f"{prefix}/failures"] = float(failed)
        return metrics


def check_scores(scores: torch.Tensor, bound: float, iteration: int, prompts: Sequence[str]) -> None:
    """Stop on a score that is not finite or beyond +-bound (reward.max_abs_score), naming it."""
    bad = ~torch.isfinite(scores) | (scores.abs() > bound)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise NonFiniteError(
            f"iteration {iteration}: the reward gave {scores[i].item():.6g} for response {i} (prompt {prompts[i]!r:.60}), "
            f"{int(bad.sum())} of {len(scores)} beyond +-{bound:g} or not finite; fix the reward, or raise "
            "reward.max_abs_score if such scores are meant")
