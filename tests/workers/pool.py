"""One rank of a pool of worker ranks (tests/conftest.WorkerPool): it starts torch.distributed once,
then runs worker cases (tests/workers/<case>.py, as a script) one after another as the host asks,
each as a fresh process would see it, megatron's parallel state made again by the case itself.

Protocol: one JSON line per case on stdin, {"script", "out", "args", "environment"}; the case's output goes to
``<out>/rank<r>.log``, and ``<out>/rank<r>.done`` holds its exit code when it is over. A case that
fails leaves the world in an unknown state (a peer may wait in a collective): the host ends the pool.

Between cases everything a case may change in this process is put back: the environment, the
working directory, the generators' seeds (set by the next case), the attributes of torch's,
megatron's and this project's modules that a case replaced (a monkeypatched function, a module
constant), signal handlers, warning filters, torch's default dtype and thread count."""

import gc
import json
import os
import runpy
import signal
import sys
import traceback
import warnings

sys.argv[1:] = [os.devnull]  # common reads a case's OUT_DIR and ARGS from the command line; each case sets its own
import common  # noqa: E402
import torch
import torch.distributed as dist

from megatron_rlhf.runtime import init_distributed
from megatron_rlhf.config.schema import ParallelConfig

# Modules whose replaced attributes are put back after a case. Only the packages' surface of torch
# (a case may wrap torch.tensor or dist.all_reduce): torch's own submodules keep counters of the
# world (distributed_c10d's group count) that must run on.
PATCHABLE_PREFIXES = ("megatron_rlhf", "megatron.core", "tests.workers")
PATCHABLE_MODULES = ("torch", "torch.distributed", "common")


def _patchable_modules():
    return {name: module for name, module in list(sys.modules.items())
            if module is not None and (name in PATCHABLE_MODULES or name.startswith(PATCHABLE_PREFIXES))}


def _module_attributes() -> dict:
    """Each patchable module's attributes (name -> value) as they are now."""
    return {name: dict(vars(module)) for name, module in _patchable_modules().items()}


CONTAINERS = (dict, list, set)


def _megatron_containers() -> dict:
    """The contents of megatron's module-level dicts, lists and sets (its caches: the copy service
    of a destroyed group, groups by name), as they are now."""
    return {(name, key): type(value)(value) for name, module in _patchable_modules().items()
            if name.startswith("megatron.core") for key, value in vars(module).items()
            if type(value) in CONTAINERS and not key.startswith("__")}  # not __builtins__, every module's


def _put_back(snapshot: dict, containers: dict) -> None:
    """Attributes a case replaced (by identity) restored, megatron's containers emptied to what they
    held; attributes a case added are left (lazy caches)."""
    for name, module in _patchable_modules().items():
        before = snapshot.get(name)
        if before is None:
            continue
        now = vars(module)
        for key, value in before.items():
            if now.get(key, value) is not value or key not in now:
                setattr(module, key, value)
    for (name, key), held in containers.items():
        container = vars(sys.modules[name])[key]
        container.clear()
        container.update(held) if isinstance(container, (dict, set)) else container.extend(held)


class ProcessState:
    """What a case may change in this process beyond module attributes, taken and put back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)

    def __init__(self):
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.handlers = {s: signal.getsignal(s) for s in self.SIGNALS}
        self.filters = list(warnings.filters)
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.modules = _module_attributes()
        self.containers = _megatron_containers()
        self.path = list(sys.path)

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        warnings.filters[:] = self.filters
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        _put_back(self.modules, self.containers)
        sys.path[:] = self.path


def _run_case(request: dict, rank: int) -> int:
    """The case's script run as ``python <script> <out> <args...>`` would run it; its exit code."""
    script, out, args = request["script"], request["out"], request["args"]
    log = os.open(os.path.join(out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(log, 1), os.dup2(log, 2)
    sys.argv = [script, out, *args]
    common.OUT_DIR, common.ARGS = out, list(args)
    world = {k: v for k, v in os.environ.items() if k in WORLD_VARIABLES}
    os.environ.clear()  # the test's environment at the case's call, as a fresh launch would get it
    os.environ.update({**request["environment"], **world})
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # a case's failure is reported, with its traceback in its log
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for fd in (*saved, log):
            os.close(fd)
    return code


# What a rank of this pool keeps of its own environment in every case: its place in the world.
WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                   "MASTER_PORT")

# Imported before the first case, so that the state of their modules as imported is what each case
# starts from (a module first imported by a case would keep what that case left in it).
PRELOADED = ("megatron_rlhf.controller", "megatron_rlhf.run_loop", "megatron_rlhf.startup", "megatron_rlhf.train",
             "megatron_rlhf.roles.weight_sync", "megatron_rlhf.generation", "megatron_rlhf.checkpoint.run_checkpoint",
             "megatron.core.resharding.refit", "megatron.core.optimizer", "megatron.core.distributed",
             "megatron.core.models.gpt", "megatron.core.transformer.moe.moe_layer")


def main() -> None:
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    rank = int(os.environ["RANK"])
    init_distributed(ParallelConfig(1, 1, False, 1))
    common.runs_in_one_world()  # a case's run keeps the world; the next case makes its groups again
    common.destroy_groups()
    pristine = ProcessState()
    for line in sys.stdin:
        request = json.loads(line)
        code = _run_case(request, rank)
        common.destroy_groups()  # the host starts a new pool when leftover groups' threads grow
        pristine.restore()
        gc.collect()
        # Whole or not at all: the pool reads the file as soon as it exists (an empty one read as a failure).
        done = os.path.join(request["out"], f"rank{rank}.done")
        with open(done + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(done + ".tmp", done)
        if code != 0:
            break


if __name__ == "__main__":
    main()
