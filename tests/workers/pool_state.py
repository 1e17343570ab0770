"""What a case finds of the process, then what it leaves changed in it: an environment variable, a
wrapped torch factory, a project module's constant, an entry in a megatron cache, a signal handler,
the working directory. Run twice in one pool (tests/test_worker_pool.py): the second finds none."""

import os
import signal

import torch
from common import save, setup
from tests.workers.findings import PoolState

from megatron.core.resharding import refit

from megatron_rlhf.generation import decode

setup(1, 1)
found = PoolState.to_fill()
found.pid = os.getpid()
found.left_behind = sorted(name for name, changed in {
    "environment": "POOL_STATE_PROBE" in os.environ,
    "torch.tensor": getattr(torch.tensor, "left_by_a_case", False),
    "module constant": decode.EXTENT_BUCKET != 32,
    "megatron cache": "left by a case" in refit._service_cache,
    "signal handler": signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL,
    "working directory": os.getcwd() == "/",
}.items() if changed)
save(found)

os.environ["POOL_STATE_PROBE"] = "1"
wrapped = lambda *a, **k: torch.Tensor.new_tensor(torch.empty(0), *a, **k)  # noqa: E731
wrapped.left_by_a_case = True
torch.tensor = wrapped
decode.EXTENT_BUCKET = 7
refit._service_cache["left by a case"] = object()
signal.signal(signal.SIGUSR1, lambda *_: None)
os.chdir("/")
