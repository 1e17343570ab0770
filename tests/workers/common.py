"""Shared helpers of the torchrun worker scripts (run by tests/conftest.py:run_workers)."""

import os
import sys

import torch
import torch.distributed as dist

# The records in tests/workers/findings.py are pickled under their package's name (the test that
# loads them imports tests.workers.findings): the checkout's root on the path, as pytest has it.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_rlhf.config.schema import ModelArchConfig, ParallelConfig
from megatron_rlhf.config.presets import PRESETS
from megatron_rlhf.runtime import init_distributed

OUT_DIR = sys.argv[1]
ARGS = sys.argv[2:]


def tiny_arch(**overrides) -> ModelArchConfig:
    return ModelArchConfig(**{**PRESETS["tiny"], **overrides})


def setup(tp: int = 1, pp: int = 1, sp: bool = False, seed: int = 1234, ep: int = 1, cp: int = 1) -> ParallelConfig:
    """Start (or switch) megatron's parallel layout within the same torch.distributed world (the
    groups of the layout before destroyed)."""
    destroy_groups()
    parallel = ParallelConfig(tp, pp, sp, ep, cp)
    init_distributed(parallel, seed=seed)
    return parallel


def rank() -> int:
    return dist.get_rank()


def save(findings) -> None:
    """This rank's findings (the worker's record in tests/workers/findings.py), for its test."""
    unset = findings.unset()
    if unset:
        raise AssertionError(f"{type(findings).__name__}: fields left unset: {', '.join(unset)}")
    torch.save(findings, os.path.join(OUT_DIR, f"rank{rank()}.pt"))
    dist.barrier()


def reward_pool(functions):
    """A rule-reward pool of one worker for ``functions`` (spec -> weight, or a bare spec); None for none."""
    from megatron_rlhf.rewards.pool import RewardPool

    if not functions:
        return None
    return RewardPool(functions if isinstance(functions, dict) else {functions: 1.0}, num_workers=1)


def hf_grads(model, arch, head) -> dict:
    """Every parameter's gradient of a TP=1 model under its Hugging Face name (padded vocabulary rows cut)."""
    from megatron_rlhf.checkpoint.hf_decoder import hf_tensors
    from megatron_rlhf.models.decoder import unwrap
    from megatron_rlhf.models.sharding import to_local_layer_names

    grads = to_local_layer_names({n: p.grad for n, p in unwrap(model).named_parameters()})
    out = {}
    for key, grad in grads.items():
        if key == "embedding.word_embeddings.weight" or (key == "output_layer.weight" and head == "lm"):
            grad = grad[: arch.vocab_size]  # the rows padded for TP
        out.update(dict(hf_tensors(key, grad, arch, head)))
    return out


def capture_partial_rows(controller) -> list:
    """Every round's rows of the controller's partial rollouts, all ranks' (in DP-rank order)."""
    captured, partial = [], controller.collector.partial
    rows_of = partial.rows

    def spy(*args):
        rows, metrics = rows_of(*args)
        captured.append({k: v.cpu() for k, v in controller.role_set.cut.gather(rows, 0).items()})
        return rows, metrics

    partial.rows = spy
    return captured


def computed_metrics(metrics: dict) -> dict:
    """An iteration's metrics but those that follow the layout or the schedule: times, the bytes a
    weight sync moved, how turns shared the decode slots."""
    from megatron_rlhf.rollout.record import SCHEDULE_METRICS

    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "weight_sync/")) and k not in SCHEDULE_METRICS}


def one_iteration(prepared, environment=None):
    """One PPO iteration of ``prepared`` (startup.prepare's) through the controller, with its
    multi-turn ``environment`` spec if any (the process groups already set up): its metrics, the
    controller and the iteration's Rollout."""
    import copy

    from megatron_rlhf.controller import PPOController
    from megatron_rlhf.memory import MemoryLedger
    from megatron_rlhf.rollout.multiturn import MultiTurn

    config = prepared.config
    turns = MultiTurn(config, prepared.tokenizer, environment, False) if environment else None
    controller = PPOController(config, copy.deepcopy(prepared.dataset), prepared.tokenizer,
                               reward_pool(prepared.reward_functions), MemoryLedger(None), turns=turns)
    captured = capture_rollouts(controller)
    metrics = controller.step()
    if turns is not None:
        turns.close()
    return metrics, controller, captured["rollout"]


def capture_rollouts(controller) -> dict:
    """``captured["rollout"]``: the Rollout of the controller's latest iteration (as its advantages
    are computed)."""
    captured = {}
    advantages = controller._advantages

    def spy(rollout):
        captured["rollout"] = rollout
        return advantages(rollout)

    controller._advantages = spy
    return captured


REWARDS_FOR_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rewards_for_tests.py")


def warm_up_gpu_libraries(arch, parallel, tokens) -> None:
    """Let the process build what CUDA libraries keep for its life, so that a level measured after
    this is a real level: cuBLAS and cuBLASLt take workspaces from the caching allocator per handle
    (one per thread: autograd's backward runs on its own) and stream at their first GEMM, 68-72 MiB
    on an H100. A throwaway role of ``arch`` trains a step with each head kind and is offloaded (a
    role with megatron's DDP is never collected: its gradient hooks live in autograd nodes)."""
    import gc

    from megatron_rlhf.config.schema import RoleConfig
    from megatron_rlhf.models.decoder import build_model
    from megatron_rlhf.models.training import next_token_loss, scalar_regression_loss, wrap_for_training
    from megatron_rlhf.roles.base import assemble_role

    for name, head, loss in (("ppo_policy", "lm", next_token_loss), ("ppo_value", "scalar", scalar_regression_loss)):
        rc = RoleConfig(precision="bf16", lr=1e-5, free_memory=True)
        model, optimizer = wrap_for_training(build_model(arch, parallel, head, precision="bf16"), rc)
        role = assemble_role(name, rc, model, optimizer)
        with role.resident("training"):
            role.train_step([{"tokens": tokens}], loss)
        del role, model, optimizer
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


class StrictCollectives:
    """Collectives as the device's NCCL groups take them, checked on the CPU: a tensor made on the
    host (torch.tensor / zeros / ones / full / empty without a device) or a Python object (the
    ``*_object*`` collectives, a barrier) that megatron_rlhf sends over any group but a host group
    (runtime/host_groups.py) is a violation, recorded with its call site; the host groups' uses are
    counted by call site. On a GPU the first kind fails (NCCL takes no CPU tensor); the second moves
    every control message through the device."""

    FACTORIES = ("tensor", "zeros", "ones", "full", "empty")
    TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce", "all_gather_into_tensor",
                          "reduce_scatter_tensor")
    OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                          "barrier")

    def __init__(self):
        from collections import Counter

        self.violations, self.host_sites = [], Counter()
        for name in self.FACTORIES:
            setattr(torch, name, self._marking(getattr(torch, name)))
        for name in self.TENSOR_COLLECTIVES + self.OBJECT_COLLECTIVES:
            setattr(dist, name, self._checking(name, getattr(dist, name)))

    @staticmethod
    def _marking(factory):
        def made(*args, **kwargs):
            tensor = factory(*args, **kwargs)
            if kwargs.get("device") is None:
                tensor._made_on_host = True
            return tensor
        return made

    def _checking(self, name, collective):
        from megatron_rlhf.runtime.host_groups import is_host_group

        def checked(*args, **kwargs):
            caller = sys._getframe(1)
            site = f"{os.path.relpath(caller.f_code.co_filename)}:{caller.f_code.co_name}"
            if "megatron_rlhf" + os.sep in caller.f_code.co_filename:
                group = kwargs.get("group")
                if is_host_group(group):
                    self.host_sites[site] += 1
                elif name in self.OBJECT_COLLECTIVES:
                    self.violations.append(f"{site}:{caller.f_lineno}: {name} on a device group")
                elif any(getattr(a, "_made_on_host", False) for a in args if torch.is_tensor(a)):
                    self.violations.append(f"{site}:{caller.f_lineno}: {name} of a host tensor on a device group")
            return collective(*args, **kwargs)
        return checked


def keep_the_world() -> None:
    """Megatron's parallel state and this project's layouts torn down, the torch.distributed world kept."""
    from megatron.core import parallel_state

    from megatron_rlhf.runtime.layouts import forget_layouts

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    forget_layouts()


def destroy_groups() -> None:
    """Megatron's groups and every other group made so far destroyed; the world and its host twins
    stay. Each layout makes some two hundred gloo threads per process, which compete for the CPU
    while idle: eleven layouts in one case took 430 s where each alone takes 12. (A group a
    leftover object still holds lives on: a role with megatron's DDP is never collected.)"""
    from megatron.core.resharding.refit import clear_service_cache
    from torch.distributed import distributed_c10d as c10d

    from megatron_rlhf.runtime import host_groups

    keep_the_world()
    clear_service_cache()  # megatron's resharding keeps a copy service on a gloo group of its own
    kept = {id(twin) for twin in host_groups._TWINS.values() if twin is not None}
    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD and id(group) not in kept:
            dist.destroy_process_group(group)


def runs_in_one_world() -> None:
    """Runs through run_loop.run, one after another in this process: each run's end tears down
    megatron's groups but keeps the world (torchrun's store takes no second rendezvous in one
    process; the next run's start-up makes its groups again)."""
    from megatron_rlhf import runtime, smoke

    runtime.destroy_distributed = smoke.destroy_distributed = keep_the_world


def run_config(config: str, output: str, *flags: str, **environment: str):
    """``config`` run to its end through the run's own entry (startup.prepare, run_loop.run) with
    ``environment`` set for it: (each step's metrics, what rank 0 printed)."""
    import contextlib
    import io

    from megatron_rlhf.run_loop import run
    from megatron_rlhf.startup import prepare
    from megatron_rlhf.train import parse_args

    before = {k: os.environ.get(k) for k in environment}
    os.environ.update(environment)
    try:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            prepared = prepare(parse_args(["--config", config, "--output-dir", output, *flags]),
                               int(os.environ["WORLD_SIZE"]))
            metrics = run(prepared)
        return metrics, printed.getvalue()
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
