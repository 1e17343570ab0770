"""A PPO checkpoint save that dies midway (an exception inside the writer) leaves the previous
checkpoint complete, `latest` pointing to it, and loadable. Run with 1 process (TP=1)."""

import os
import threading
import time

import torch
from common import OUT_DIR, reward_pool, save
from tests.workers.findings import PPOCheckpointCrash

from megatron_rlhf.checkpoint import background as background_module
from megatron_rlhf.checkpoint import run_checkpoint
from megatron_rlhf.checkpoint.background import CheckpointSaves
from megatron_rlhf.controller import PPOController
from megatron_rlhf.errors import RunError
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.runtime import init_distributed
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args
from megatron_rlhf.run_loop import checkpoint_state, resume

os.environ["TP"] = "1"
prepared = prepare(parse_args(["--config", "examples/tiny/rlhf.yaml", "--output-dir", OUT_DIR]), 1)
config, tokenizer, dataset = prepared.config, prepared.tokenizer, prepared.dataset
config.ppo.rollout_batch_size = 8
init_distributed(config.parallel, seed=config.seed)
controller = PPOController(config, dataset, tokenizer, reward_pool(prepared.reward_functions), MemoryLedger(None))
controller.step()
first = run_checkpoint.save_checkpoint(controller.roles, checkpoint_state(controller, None), OUT_DIR)
controller.step()

real_save = torch.save


def failing_save(obj, path, *args, **kwargs):
    if "ppo_value" in str(path) and "optim" in str(path):
        raise OSError("disk full (simulated)")
    return real_save(obj, path, *args, **kwargs)


def read_only_save(obj, path, *args, **kwargs):  # what torch.save raises for a folder it cannot write
    if "trainer_state" in str(path):
        raise RuntimeError(f"File {path} cannot be opened.")
    return real_save(obj, path, *args, **kwargs)


def error_of_a_save(patched_save, in_background: bool = False):
    """The RunError's text of a checkpoint save made with torch.save replaced by ``patched_save``
    (in the background: said when the save is drained), or None."""
    run_checkpoint.torch.save = patched_save
    try:
        saves = CheckpointSaves(in_background=in_background)
        saves.save(controller.roles, checkpoint_state(controller, None), OUT_DIR)
        saves.drain()
    except RunError as e:
        return str(e)
    finally:
        run_checkpoint.torch.save = real_save
    return None


error, read_only_error = error_of_a_save(failing_save), error_of_a_save(read_only_save)
# The same full disk met by the background writer (trainer.async_save): said when the save is drained.
background_error = error_of_a_save(failing_save, in_background=True)

latest = run_checkpoint.latest_checkpoint(OUT_DIR)
fresh = PPOController(config, dataset, tokenizer, controller.collector.scorer.reward_pool, MemoryLedger(None))
real_load, map_locations = torch.load, []


def recording_load(*args, **kwargs):
    map_locations.append(kwargs.get("map_location"))
    return real_load(*args, **kwargs)


run_checkpoint.torch.load = recording_load
resume(fresh, latest)
run_checkpoint.torch.load = real_load
listing = sorted(os.listdir(os.path.join(OUT_DIR, "checkpoints")))


def tensors_in(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def role_memory_spans(roles):
    """Address ranges of every role's storages (device or host) and EMS host arenas."""
    spans = []
    for role in roles.values():
        for kind in ("weights", "grads", "main_params", "optimizer_state"):
            for t in role.memory.tensors(kind):
                storage = t.untyped_storage()
                if storage.nbytes():
                    spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        for mover in role.memory._movers.values():
            if mover._arena is not None:
                spans.append((mover._arena.data_ptr(), mover._arena.data_ptr() + mover._arena.numel()))
    return spans


# A background save held in flight (its writer waits): what does the writer hold?
release, held = threading.Event(), []


def held_write(writes):
    held.append(writes)
    release.wait()
    real_write(writes)


real_write, background_module.write_files = background_module.write_files, held_write
saves = CheckpointSaves(in_background=True)
saves.save(fresh.roles, checkpoint_state(fresh, None), OUT_DIR)
while not held:
    time.sleep(0.01)
spans = role_memory_spans(fresh.roles)
written = [t for _, obj in held[0] for t in tensors_in(obj)]
shares = any(t.untyped_storage().nbytes() and any(a < t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()
                                                    and t.untyped_storage().data_ptr() < b for a, b in spans)
             for t in written)
writer_holds = {"tensors": len(written), "bytes": sum(t.untyped_storage().nbytes() for t in written),
                "shares_role_memory": shares, "pinned": any(t.is_pinned() for t in written)}
resident = {name: sum(role.memory.resident_bytes().values()) for name, role in fresh.roles.items()}
release.set()
saves.drain()
background_module.write_files = real_write
save(PPOCheckpointCrash(error=error, read_only_error=read_only_error, background_error=background_error, first=first, latest=latest, resumed_iteration=fresh.iteration,
                        listing=listing, map_locations=map_locations, writer_holds=writer_holds,
                        resident_while_writing=resident, held_save=run_checkpoint.latest_checkpoint(OUT_DIR)))
