"""Weight sync: after training, the inference role (policy, value) serves the trained weights
(ppo_policy, ppo_value).

Where the two networks share a parallel layout their shards match name by name. Where the dtypes
match too, the inference role's parameters become views of the trained role's storage once, at
start-up: no copy ever, and one copy of the weights in memory. Otherwise (e.g. fp32 training
serving a bf16 policy) the weights are copied at start-up and after every training phase. A model
of another layout (its own TP/PP, runtime/layouts.py) gets them through megatron-core's resharding
(``reshard_weights``): each rank sends the slices of its shards that the other layout's ranks hold.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_rlhf.memory.kinds import RESHARD_BUFFERS, WEIGHTS
from megatron_rlhf.models.decoder import unwrap
from megatron_rlhf.models.lora import has_adapters, is_adapter
from megatron_rlhf.roles.base import Role


def reshard_weights(trained: torch.nn.Module, serving: torch.nn.Module, holding=None, adapters_only: bool = False) -> None:
    """Copy ``trained``'s weights into ``serving``, a model of the same network at another TP/PP
    (built on its own process groups, with the same padded vocabulary), by megatron-core's
    resharding over the platform's collective backend (gloo on CPU, NCCL on CUDA). Collective over
    the world; the plan is made on the first call and reused. ``holding(tensors)``: a context
    manager around the transfer, given the buffers megatron allocated for it (the ledger's record).
    ``adapters_only``: the LoRA adapters alone (a later call: the frozen base is there already)."""
    from megatron.core.resharding.refit import get_or_create_service, swap_model_weights

    from megatron_rlhf.runtime.megatron_compat import reshard_part, sequential_experts_resharded
    from megatron_rlhf.runtime.platform import get_platform

    service = get_or_create_service(get_platform().dist_backend)
    if holding is not None:
        models = (unwrap(trained), unwrap(serving))
        service = _buffer_recorder(service, {p.untyped_storage().data_ptr() for m in models for p in m.parameters()}, holding)
    with torch.no_grad(), sequential_experts_resharded():
        if adapters_only:
            reshard_part(unwrap(trained), unwrap(serving), service, is_adapter)
        else:
            swap_model_weights(unwrap(trained), unwrap(serving), service)


def _buffer_recorder(service, parameter_storages, holding):
    """megatron's copy ``service``, seeing every tensor the resharding submits: the ones of storages
    of their own (receive buffers, contiguous copies of sent slices; not views of the models'
    parameters) are held by ``holding`` while the transfer runs."""
    from megatron.core.resharding.copy_services.base import CopyService

    class BufferRecorder(_BufferRecorder, CopyService):  # megatron takes a CopyService instance
        pass

    return BufferRecorder(service, parameter_storages, holding)


class _BufferRecorder:
    def __init__(self, service, parameter_storages, holding):
        self.service, self.parameter_storages, self.holding = service, parameter_storages, holding
        self.buffers = []

    def _keep(self, tensor: torch.Tensor) -> None:
        if tensor.untyped_storage().data_ptr() not in self.parameter_storages:
            self.buffers.append(tensor)

    def submit_send(self, tensor, rank):
        self._keep(tensor)
        self.service.submit_send(tensor, rank)

    def submit_send_with_id(self, task_id, tensor, rank):
        self._keep(tensor)
        self.service.submit_send_with_id(task_id, tensor, rank)

    def submit_recv(self, tensor, rank):
        self._keep(tensor)
        self.service.submit_recv(tensor, rank)

    def submit_recv_with_id(self, task_id, tensor, rank):
        self._keep(tensor)
        self.service.submit_recv_with_id(task_id, tensor, rank)

    def run(self):
        with self.holding(self.buffers):
            self.service.run()
        self.buffers = []


def received_bytes(serving: torch.nn.Module, adapters_only: bool = False) -> int:
    """The bytes this rank receives in each resharding into ``serving`` (from megatron's cached plan:
    its receive buffers, one per slice, live until the copy is done); of the adapters alone if asked."""
    from megatron_rlhf.runtime.megatron_compat import reshard_receives

    params = dict(unwrap(serving).named_parameters())
    return sum(params[name].data[where].numel() * params[name].element_size()
               for name, where in reshard_receives(unwrap(serving))
               if name in params and (is_adapter(name) or not adapters_only))


class WeightSync:
    """``share``: the serving role's parameters become views of the trained role's storage (the
    config's rule, RLHFConfig.weight_owner: same precision and layout); ``reshard``: the serving
    role runs at a layout of its own and gets the weights by megatron's resharding; otherwise
    weights are copied name by name. Under LoRA the frozen base goes once (and again when asked:
    after a checkpoint's weights were loaded); later syncs move the adapters alone."""

    def __init__(self, trained: Role, serving: Role, share: bool, reshard: bool = False):
        self.trained, self.serving = trained, serving
        self.shared, self.resharded = share, reshard
        self.base_served = False
        if reshard:
            if share:
                raise ValueError(f"weight sync {trained.name} -> {serving.name}: roles of two layouts cannot share storage")
            self()
            return
        src = dict(unwrap(trained.model).named_parameters())
        dst = dict(unwrap(serving.model).named_parameters())
        if not has_adapters(serving.model):  # the reference served by a LoRA policy: its base
            src = {n: p for n, p in src.items() if not is_adapter(n)}
        mismatched = [n for n in src if n not in dst or dst[n].shape != src[n].shape]
        if mismatched or src.keys() != dst.keys():
            raise ValueError(
                f"weight sync {trained.name} -> {serving.name}: the networks differ "
                f"(first mismatching parameters: {(mismatched or sorted(set(dst) ^ set(src)))[:3]})"
            )
        self.pairs = [(src[n], dst[n]) for n in src]
        self.adapter_pairs = [(src[n], dst[n]) for n in src if is_adapter(n)]
        if share and any(s.dtype != d.dtype for s, d in self.pairs):
            raise ValueError(f"weight sync {trained.name} -> {serving.name}: storage sharing needs one dtype")
        if self.shared:
            with self._both_onloaded():
                for s, d in self.pairs:
                    d.data = s.data
                serving.memory.share_weights_with(trained.memory)
        else:
            self()  # serve the trained role's starting weights: only it needs a `load` checkpoint

    def __call__(self, whole: bool = False) -> int:
        """Bring the serving role up to date (nothing to do when it shares the storage); returns
        the bytes this rank's serving shard received. ``whole``: the frozen base of a LoRA network too."""
        if self.shared:
            return 0
        adapters_only = self.base_served and not whole and has_adapters(self.serving.model)
        self.base_served = True
        with self._both_onloaded(), torch.no_grad():
            if self.resharded:
                holding = lambda buffers: self.serving.memory.holding(RESHARD_BUFFERS, buffers, "weight sync")  # noqa: E731
                reshard_weights(self.trained.model, self.serving.model, holding, adapters_only)
                return received_bytes(self.serving.model, adapters_only)
            pairs = self.adapter_pairs if adapters_only else self.pairs
            for s, d in pairs:
                d.copy_(s)
        return sum(d.numel() * d.element_size() for _, d in pairs)

    @contextlib.contextmanager
    def _both_onloaded(self):
        self.trained.memory.onload([WEIGHTS])
        self.serving.memory.onload([WEIGHTS])
        try:
            yield
        finally:
            self.serving.memory.offload()
            self.trained.memory.offload()
