"""Environment calls in worker processes, concurrent over the workers, each with a time-out.

An environment may hang, crash or run away; the rollout must not. Each trajectory's instance lives
in one worker (trajectory id modulo the workers), so its calls are in order, and the workers run
side by side. A call that outlives ``timeout_s`` has its worker killed and replaced; the other
trajectories that lived there are rebuilt in the new worker by replaying their calls (their
environments are deterministic functions of those calls, as the protocol asks), so a hang costs
only its own trajectory; an environment whose first calls of a batch all time out (twice per
worker, nothing answered) blocks, and the batch's other calls are not made (they fail at once, as
the reward pool stops). Workers are plain interpreters without torch (rollout/env_worker.py).
"""

from __future__ import annotations

import json
import os
import time
from multiprocessing.connection import wait
from typing import Any, Dict, List, Optional, Tuple

from megatron_rlhf.rewards.pool import BLOCKED_AFTER, WorkerProcess

Request = Tuple[int, str, Any]  # (trajectory, "start" | "step", payload)
Outcome = Tuple[str, Any]  # ("ok", result) or (failure kind: raised | protocol | timeout | exited | memory, reason)
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_mb(pid: int) -> float:
    """A process's resident memory (MB), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


class _Worker(WorkerProcess):
    def __init__(self, spec: str, timeout_s: float, options: Dict[str, Any]):
        super().__init__("megatron_rlhf.rollout.env_worker", [spec, json.dumps(options)])
        self.task: Optional[int] = None  # index of the request being answered
        if not self.conn.poll(timeout_s + 60.0):
            self.kill()
            raise ValueError(f"environment {spec}: its worker took over {timeout_s + 60:.0f}s to load it")
        try:
            kind, message = self.conn.recv()
        except EOFError:
            raise ValueError(f"environment {spec}: its worker ended while loading it (exit code {self.process.wait()})") from None
        if kind != "ready":
            self.kill()
            raise ValueError(message)


class EnvironmentPool:
    """``options``: the keyword arguments every instance is made with (JSON; none: no arguments).
    ``memory_mb``: a worker resident beyond it after an answer fails that call and is replaced (an
    environment that keeps growing is stopped; its worker's other trajectories rebuilt by replay)."""

    def __init__(self, spec: str, num_workers: int = 2, timeout_s: float = 30.0, options: Optional[Dict[str, Any]] = None,
                 memory_mb: Optional[float] = None):
        self.spec, self.timeout_s, self.options, self.memory_mb = spec, timeout_s, options or {}, memory_mb
        self.workers: List[_Worker] = []
        try:
            for _ in range(num_workers):
                self.workers.append(self._new_worker())
        except BaseException:
            self.close()
            raise
        self.history: Dict[int, List[Tuple[str, Any]]] = {}  # each live trajectory's answered calls
        self.lost: Dict[int, str] = {}  # trajectories whose rebuild failed -> why
        self._requests: Dict[int, Request] = {}  # by ticket, until polled
        self._queues: Dict[int, List[int]] = {}  # per worker, the tickets not yet sent
        self._ready: List[Tuple[int, Outcome]] = []  # answered, not yet polled
        self._next_ticket = 0
        self.begin()

    def _new_worker(self) -> _Worker:
        return _Worker(self.spec, self.timeout_s, self.options)

    def _home(self, trajectory: int) -> int:
        return trajectory % len(self.workers)

    def call(self, requests: List[Request]) -> List[Outcome]:
        """Answer every request, each trajectory's in order, the workers side by side."""
        self.begin()
        tickets = self.submit(requests)
        answered: Dict[int, Outcome] = {}
        while len(answered) < len(tickets):
            answered.update(self.poll(None))
        return [answered[t] for t in tickets]

    # -- calls answered as they come: submit, then poll ------------------------------------------

    def begin(self) -> None:
        """A new batch: an environment blocks when the batch's first calls all time out."""
        self._timeouts, self._answered = 0, False

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet answered by :meth:`poll`."""
        return len(self._requests)

    def submit(self, requests: List[Request]) -> List[int]:
        """Queue ``requests`` (each trajectory's after its earlier ones); their tickets, in order."""
        tickets = []
        for trajectory, kind, payload in requests:
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self._requests[ticket] = (trajectory, kind, payload)
            if trajectory in self.lost:
                self._ready.append((ticket, ("exited", self.lost[trajectory])))
            else:
                self._queues.setdefault(self._home(trajectory), []).append(ticket)
            tickets.append(ticket)
        return tickets

    def poll(self, timeout: Optional[float] = 0.0) -> List[Tuple[int, Outcome]]:
        """The outcomes answered so far, by ticket: waits up to ``timeout`` seconds for a first one
        (None: until one comes, while any is outstanding)."""
        until = None if timeout is None else time.monotonic() + timeout
        while not self._ready and self._requests:
            self._send_queued()
            busy = [w for w in self.workers if w.task is not None]
            if not busy:
                break
            deadline = min(w.deadline for w in busy)
            if until is not None:
                deadline = min(deadline, until)
            wait([w.conn for w in busy], timeout=max(0.0, deadline - time.monotonic()))
            self._collect(busy)
            if until is not None and time.monotonic() >= until:
                break
        self._send_queued()  # the next calls run while the caller works
        ready, self._ready = self._ready, []
        for ticket, _ in ready:
            del self._requests[ticket]
        return ready

    def _send_queued(self) -> None:
        for w, worker in enumerate(self.workers):
            if worker.task is None and self._queues.get(w):
                worker.task = self._queues[w].pop(0)
                trajectory, kind, payload = self._requests[worker.task]
                worker.deadline = time.monotonic() + self.timeout_s
                worker.conn.send((kind, trajectory, payload))

    def _collect(self, busy: List[_Worker]) -> None:
        """The answers (or time-outs) of the ``busy`` workers that have one."""
        for worker in busy:
            ticket = worker.task
            trajectory, kind, payload = self._requests[ticket]
            if worker.conn.poll():
                try:
                    outcome = worker.conn.recv()
                except EOFError:
                    outcome = ("exited", f"ended its worker process (exit code {worker.process.wait()})")
            elif time.monotonic() >= worker.deadline:
                outcome = ("timeout", f"took over {self.timeout_s:g}s (rollout.env_timeout_s)")
            else:
                continue
            if outcome[0] == "ok" and self.memory_mb is not None:
                resident = resident_mb(worker.process.pid)
                if resident > self.memory_mb:
                    outcome = ("memory", f"grew its worker to {resident:.0f} MB, beyond rollout.env_memory_mb="
                                         f"{self.memory_mb:g} (the worker was replaced)")
            worker.task = None
            self._ready.append((ticket, outcome))
            self._timeouts += outcome[0] == "timeout"
            self._answered = self._answered or outcome[0] != "timeout"
            if not self._answered and self._timeouts >= BLOCKED_AFTER * len(self.workers):  # as the reward pool stops
                self._give_up()
            if outcome[0] == "ok":
                self.history.setdefault(trajectory, []).append((kind, payload))
            elif outcome[0] in ("timeout", "exited", "memory"):
                self._replace(worker, trajectory)

    def _give_up(self) -> None:
        """Answer every request not yet sent: the environment's first calls all timed out."""
        for queue in self._queues.values():
            for ticket in queue:
                self._ready.append((ticket, ("timeout", f"was not made: the first {self._timeouts} calls of the batch all "
                                                        f"timed out (rollout.env_timeout_s={self.timeout_s:g}s), nothing "
                                                        f"answered: the environment blocks")))
            queue.clear()

    def _replace(self, worker: _Worker, failed: int) -> None:
        """A fresh worker for ``worker``, the other trajectories it held rebuilt by replay."""
        w = self.workers.index(worker)
        worker.kill()
        self.workers[w] = fresh = self._new_worker()
        self.history.pop(failed, None)
        held = [t for t in self.history if self._home(t) == w and t not in self.lost]
        for trajectory in held:
            for kind, payload in self.history[trajectory]:
                fresh.conn.send((kind, trajectory, payload))
                if not fresh.conn.poll(self.timeout_s):  # hung again: a last fresh worker, what it held lost
                    fresh.kill()
                    self.workers[w] = self._new_worker()
                    for other in held:
                        self.lost.setdefault(other, "was lost when its worker was replaced twice (replaying its calls hung)")
                    return
                try:
                    answered = fresh.conn.recv()[0] == "ok"
                except EOFError:
                    answered = False
                if not answered:
                    self.lost[trajectory] = "could not be rebuilt after its worker was replaced (replaying its calls failed)"
                    if fresh.process.poll() is not None:
                        self.workers[w] = fresh = self._new_worker()
                    break

    def release(self, trajectories: List[int]) -> None:
        """Drop the instances of ``trajectories`` (their batch is done)."""
        for trajectory in trajectories:
            if trajectory not in self.lost:
                self.workers[self._home(trajectory)].conn.send(("close", trajectory, None))
            self.history.pop(trajectory, None)
            self.lost.pop(trajectory, None)

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []
