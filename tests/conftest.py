import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from megatron_rlhf.runtime.platform import DEVICE_VARIABLE

REPO = Path(__file__).resolve().parent.parent
# Every test runs on the CPU (multi-process tests over gloo, on any machine, however many GPUs it
# has), except the tests marked `gpu`, whose workers get ON_GPU.
os.environ[DEVICE_VARIABLE] = "cpu"
ON_GPU = {DEVICE_VARIABLE: "cuda"}
# hypothesis keeps its caches under the working directory unless told otherwise: not in the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "megatron-rlhf-hypothesis"))


def pytest_collection_modifyitems(config, items):
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.args[0] if marker.args else 1
        if present < needed:
            have = f"{present} present" if present else "no CUDA device on this machine"
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} GPU{'s' if needed > 1 else ''} ({have})"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_environment(extra=None) -> dict:
    """The environment a worker rank starts with: this process's, one thread, no warnings, ``extra``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(extra or {})}


def _rank_environment(env: dict, rank: int, nprocs: int, port: str) -> dict:
    """``env`` with the variables torchrun gives rank ``rank`` of ``nprocs`` on one machine."""
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


def spawn_ranks(cmd, nprocs: int, env: dict, timeout: float, logs: Path, stderr_apart: bool = False):
    """Run ``cmd`` as ranks 0..nprocs-1 of one torch.distributed world on this machine, as torchrun
    would start them (its environment variables), without torchrun's own process (1.7 s a launch).
    A rank that fails ends the others (as torchrun does); returns each rank's exit code and output
    (``stderr_apart``: its standard output and its standard error)."""
    import time

    port, procs = str(_free_port()), []
    for rank in range(nprocs):
        out = open(logs / f"rank{rank}.log", "w+")
        err = open(logs / f"rank{rank}.err", "w+") if stderr_apart else None
        rank_env = _rank_environment(env, rank, nprocs, port)
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=out, stderr=err or subprocess.STDOUT),
                      out, err))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, *_ in procs):
        failed = any(p.poll() not in (None, 0) for p, *_ in procs)
        if failed or time.monotonic() > deadline:
            time.sleep(0.2 if failed else 0)  # a failed rank's peers get a moment to say why
            for p, *_ in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    results = []
    for p, *files in procs:
        code = p.wait()
        texts = []
        for f in files:
            if f is not None:
                f.seek(0)
                texts.append(f.read())
                f.close()
        results.append((code, *texts))
    return results


class WorkerPool:
    """``nprocs`` ranks of one world (tests/workers/pool.py) that run worker cases one after another:
    one start-up (torch, megatron, the world) per world size instead of one per case. A case that
    fails or runs past its time ends the pool (a peer may be waiting in a collective); the next case
    starts a new one."""

    # Threads of a rank past which the pool starts again: the gloo groups of objects a case left
    # uncollected (roles with megatron's DDP) keep two threads each, and their timed waits take
    # CPU from the cases (about 5% of a core at 300).
    MAX_THREADS = 300

    def __init__(self, nprocs: int, root: Path):
        self.nprocs, self.root, self.procs, self.logs = nprocs, root, [], None

    def _start(self) -> None:
        logs = self.logs = self.root / f"start{len(list(self.root.iterdir()))}"
        logs.mkdir()
        port = str(_free_port())
        env = _worker_environment()
        for rank in range(self.nprocs):
            out = open(logs / f"rank{rank}.log", "w")
            rank_env = _rank_environment(env, rank, self.nprocs, port)
            self.procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "workers" / "pool.py")], cwd=REPO,
                                               env=rank_env, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                               text=True))
            out.close()

    def _threads(self) -> int:
        return max(len(os.listdir(f"/proc/{p.pid}/task")) for p in self.procs) if os.path.isdir("/proc") else 0

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.procs = []

    def run(self, script: Path, out: Path, args, timeout: float):
        """Each rank's exit code and output for one case (as spawn_ranks returns them)."""
        import json
        import time

        if not self.procs or any(p.poll() is not None for p in self.procs):
            self.close()
            self._start()
        request = json.dumps({"script": str(script), "out": str(out), "args": list(args),
                              "environment": _worker_environment()}) + "\n"  # the test's now, as a fresh launch's
        for p in self.procs:
            p.stdin.write(request)
            p.stdin.flush()
        done = [out / f"rank{r}.done" for r in range(self.nprocs)]
        deadline = time.monotonic() + timeout
        while not all(d.exists() for d in done):
            failed = any(d.exists() and d.read_text() not in ("", "0") for d in done)
            dead = any(p.poll() is not None for p in self.procs)
            if failed or dead or time.monotonic() > deadline:
                time.sleep(0.2)  # a failed rank's peers get a moment to say why
                self.close()
                break
            time.sleep(0.02)
        if self.procs and self._threads() > self.MAX_THREADS:
            self.close()  # now, not before the next case: idle, their threads would still take CPU
        results = []
        for r, d in enumerate(done):
            code = int(d.read_text() or 1) if d.exists() else -9
            log = out / f"rank{r}.log"
            results.append((code, log.read_text() if log.exists() else
                            "(no output of the case: the pool ended before it began; the pool's own) " +
                            (self.logs / f"rank{r}.log").read_text()))
        return results


_POOLS: dict = {}  # world size -> its WorkerPool, for the session


def _pool(nprocs: int) -> WorkerPool:
    import atexit
    import tempfile

    if nprocs not in _POOLS:
        if not _POOLS:
            atexit.register(lambda: [pool.close() for pool in _POOLS.values()])
        _POOLS[nprocs] = WorkerPool(nprocs, Path(tempfile.mkdtemp(prefix=f"worker_pool{nprocs}_")))
    return _POOLS[nprocs]


def run_workers(tmp_path: Path, nprocs: int, case: str, *args: str, timeout: int = 300, env=None):
    """Run ``tests/workers/<case>.py`` as ``nprocs`` ranks of one world (in the session's pool of that
    world size; a fresh launch where ``env`` sets variables of its own, e.g. the GPU's); return the
    record each rank saved (its type declared in tests/workers/findings.py), indexed by rank."""
    from tests.workers.findings import FINDINGS

    out = tmp_path / f"{case}_{nprocs}"
    out.mkdir(parents=True, exist_ok=True)
    script = REPO / "tests" / "workers" / f"{case}.py"
    if env:
        results = spawn_ranks([sys.executable, str(script), str(out), *args], nprocs, _worker_environment(env), timeout, out)
    else:
        results = _pool(nprocs).run(script, out, args, timeout)
    if any(code != 0 for code, _ in results):
        told = "\n".join(f"--- rank {r} (exit {code}):\n{text[-6000:]}" for r, (code, text) in enumerate(results))
        raise AssertionError(f"{case} {' '.join(args)} on {nprocs} ranks failed:\n{told}")
    found = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]
    assert all(type(f) is FINDINGS[case] for f in found), f"{case}: saved {type(found[0]).__name__}, not {FINDINGS[case].__name__}"
    return found


_NOT_THE_CHECKOUT = {".git", ".venv", ".pytest_cache", "__pycache__"}


def _checkout_entries() -> set:
    found = set()
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in _NOT_THE_CHECKOUT and not d.endswith(".egg-info")]
        found.update(os.path.relpath(os.path.join(root, name), REPO) for name in dirs + files)
    return found


@pytest.fixture(scope="session", autouse=True)
def nothing_written_into_the_checkout():
    """Tests write only under their temporary directories: a stray file in the checkout (once a
    checkpoint directory `2/` at its root) fails the session, naming what appeared."""
    before = _checkout_entries()
    yield
    stray = sorted(_checkout_entries() - before)
    if stray:
        pytest.fail(f"the tests wrote into the checkout {REPO}: {', '.join(stray[:20])}", pytrace=False)


@pytest.fixture
def workers(tmp_path):
    def run(nprocs, case, *args, **kwargs):
        return run_workers(tmp_path, nprocs, case, *args, **kwargs)

    return run


@pytest.fixture
def launch_environment():
    """os.environ without the launch variables, restored afterwards whatever the test wrote into it
    (the launcher and the plan command resolve their environment into os.environ)."""
    saved = dict(os.environ)
    for name in ("TP", "PP", "CP", "EP", "NNODES", "GPUS_PER_NODE", "MASTER_ADDR", "MODEL_SIZE", "POLICY_PRESET", "REWARD_PRESET",
                 "OUTPUT_DIR", "PROMPT_FILE"):
        os.environ.pop(name, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)
