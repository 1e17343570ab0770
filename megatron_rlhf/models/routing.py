"""Routing replay (``moe.routing_replay``): the experts each token of a sample was sent to, recorded in
one forward of the sample and replayed in every later forward of it, so that a PPO ratio compares the
same experts even after optimizer steps have moved the router (or where the rollout's kernels rounded
differently from training's).

A record is a per-row column ``routes`` [B, S, L, K] (int8, or int32 past 127 experts): for each
position of each row, the K experts chosen by each of this pipeline stage's L layers with experts,
-1 where nothing was recorded (padding; a response's last token, which generation never feeds).
It travels with the rows like any other per-token column (models/batches.py trims it with them).
Replay routes a recorded token to its recorded experts, weighted by the router's current scores of
those experts (so the router still learns); a token without a record routes as computed.

Built on megatron-core's hook for this (the router asks ``router_replay.get_replay_topk`` for its
top-k); our per-layer object is held by each model rather than in megatron's process-wide list,
because every role has routers of its own.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from megatron_rlhf.models.decoder import unwrap

ROUTES = "routes"  # the micro-batch / rollout column


def routes_dtype(num_experts: int) -> torch.dtype:
    """The smallest type that holds every expert index and -1 and that gloo and NCCL move (not int16)."""
    return torch.int8 if num_experts <= 127 else torch.int32


def _layer_replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class LayerReplay(RouterReplay):
        """megatron's per-layer replay hook, replaying only the tokens with a record (``target``
        [T, K], -1 rows route as computed); not registered in megatron's process-wide list."""

        def __init__(self, device: torch.device):  # RouterReplay.__init__ would append self to the process-wide list
            self.target_topk_idx = self.recorded_topk_idx = None
            self.router_replay_action = None
            self.replay_backward_list = []
            self.counts = torch.zeros(2, dtype=torch.long, device=device)  # tokens replayed, of which the router would move

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action is not RouterReplayAction.REPLAY_FORWARD:
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            target = self.target_topk_idx.to(device=scores.device, dtype=torch.long)
            if target.shape != (scores.shape[0], topk):
                raise ValueError(f"routing replay: a record of {tuple(target.shape)} for {scores.shape[0]} tokens, top-{topk}")
            _, computed = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            known = target[:, 0] >= 0
            # How many recorded tokens the router, left alone, would send elsewhere now.
            moved = (computed.sort(dim=1).values != target.sort(dim=1).values).any(dim=1) & known
            self.counts += torch.stack([known.sum(), moved.sum()])
            indices = torch.where(known[:, None], target, computed)
            return scores.gather(1, indices), indices

    return LayerReplay, RouterReplayAction


def routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The routers of this stage's layers with experts, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]


def enable(model: torch.nn.Module) -> None:
    """Give every router of ``model`` a replay hook (idle until ``recording`` or ``replaying``).
    The model is marked whether or not this stage has layers with experts, so that every stage
    takes part in the collectives alike."""
    LayerReplay, _ = _layer_replay_class()
    inner = unwrap(model)
    inner.routing_replay_device = next(inner.parameters()).device
    for router in routers(model):
        if not isinstance(router.router_replay, LayerReplay):
            router.router_replay = LayerReplay(inner.routing_replay_device)
    # Found once: every micro-batch and every engine step reads them.
    inner.routing_replay_hooks = [router.router_replay for router in routers(model)]


def enabled(model: torch.nn.Module) -> bool:
    """Whether ``enable`` was called on ``model``."""
    return hasattr(unwrap(model), "routing_replay_hooks")


def _hooks(model: torch.nn.Module) -> list:
    if not enabled(model):
        raise RuntimeError("routing replay: this model has no replay hooks (routing.enable was not called)")
    return unwrap(model).routing_replay_hooks


@contextlib.contextmanager
def _acting(hooks: list, action):
    """``hooks`` take ``action`` within; afterwards they are idle and hold no indices."""
    for hook in hooks:
        hook.set_router_replay_action(action)
    try:
        yield
    finally:
        for hook in hooks:
            hook.clear_router_replay_action()
            hook.clear_indices()


@contextlib.contextmanager
def recording(model: torch.nn.Module):
    """Within: every forward of ``model`` records its routing (read it with ``recorded``)."""
    _, Action = _layer_replay_class()
    with _acting(_hooks(model), Action.RECORD):
        yield


def recorded(model: torch.nn.Module, tokens: int) -> torch.Tensor:
    """The routing of the last forward, of ``tokens`` tokens: [T, L, K] (megatron's token order: for
    a [b, s] batch, position-major, as the layers see hidden states [s, b, h]; L = 0 on a stage
    without experts)."""
    hooks = _hooks(model)
    if not hooks:
        return torch.empty(tokens, 0, unwrap(model).config.moe_router_topk, dtype=torch.long,
                           device=unwrap(model).routing_replay_device)
    return torch.stack([hook.get_recorded_indices() for hook in hooks], dim=1)


def as_rows(flat: torch.Tensor, batch: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """A [b, s] batch's routing as ``recorded`` gives it, [s * b, L, K] -> [b, s, L, K]."""
    return flat.reshape(seq, batch, *flat.shape[1:]).transpose(0, 1).to(dtype)


def moved_share(model: torch.nn.Module, groups) -> Optional[float]:
    """The share of replayed (token, layer) routings since the last call whose experts the router
    would have chosen otherwise (summed over this stage's layers and ``groups``: the pipeline and
    data-parallel groups), None where nothing was replayed; the counts restart. Collective over ``groups``."""
    import torch.distributed as dist

    hooks = _hooks(model)
    counts = sum((hook.counts for hook in hooks), torch.zeros(2, dtype=torch.long, device=unwrap(model).routing_replay_device))
    for hook in hooks:
        hook.counts = torch.zeros_like(hook.counts)
    for group in groups:
        dist.all_reduce(counts, group=group)
    replayed, moved = counts.tolist()
    return moved / replayed if replayed else None


@contextlib.contextmanager
def replaying(model: torch.nn.Module, routes: Optional[torch.Tensor]):
    """Within: every forward of ``model`` on the [b, s] batch whose record is ``routes``
    [b, s, L, K] routes each recorded token to its recorded experts. ``routes`` None: nothing changes."""
    if routes is None:
        yield
        return
    _, Action = _layer_replay_class()
    hooks = _hooks(model)
    if routes.shape[2] != len(hooks):
        raise ValueError(f"routing replay: a record of {routes.shape[2]} layers with experts for a stage with {len(hooks)}")
    flat = routes.transpose(0, 1).flatten(0, 1)  # megatron's token order
    for layer, hook in enumerate(hooks):
        hook.set_target_indices(flat[:, layer])
    with _acting(hooks, Action.REPLAY_FORWARD):
        yield
