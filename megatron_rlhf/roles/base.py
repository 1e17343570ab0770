"""A role: one RLHF network (its TP/PP shard on this rank), its optimizer when trainable, and its
EMS memory manager. Behaviour specific to each role (generate, log-probs, scores, PPO losses)
builds on this."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from megatron_rlhf.config.schema import REPLAYING_ROLES, ROLE_HEADS, RLHFConfig, RoleConfig
from megatron_rlhf.errors import NoGradientError
from megatron_rlhf.memory.kinds import WEIGHTS, EMSSwitches
from megatron_rlhf.memory.manager import RoleMemory
from megatron_rlhf.models import routing
from megatron_rlhf.models.decoder import build_model, groups_of, load_local_state_dict, local_state_dict, unwrap
from megatron_rlhf.models.lora import add_adapters, load_adapters
from megatron_rlhf.models.pipeline import LossFn, MicroBatch, Reduce, forward_backward
from megatron_rlhf.models.sharding import shard_state_dict
from megatron_rlhf.models.training import train_step, wrap_for_training
from megatron_rlhf.runtime.distributed import set_seed
from megatron_rlhf.runtime.layouts import layout_groups


@dataclasses.dataclass
class Role:
    name: str
    config: RoleConfig
    model: torch.nn.Module  # megatron DDP around the network for trainable roles
    optimizer: Optional[Any]
    memory: RoleMemory

    def resident(self, phase: str):
        """``with role.resident("inference" | "training"): ...``: onload what the phase needs,
        offload the role's switched-on kinds afterwards."""
        return self.memory.resident(phase)

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    @property
    def head(self) -> str:
        return ROLE_HEADS[self.name]

    def forward(self, micro_batches: List[MicroBatch], reduce: Optional[Reduce] = None,
                routes_out: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
        """Per micro-batch on the last pipeline stage: the output ([b, s, vocab/TP] or [b, s, 1]),
        or ``reduce(output, micro_batch)`` when given (so full logits need not be kept); [] on
        other stages. ``routes_out``: see forward_backward."""
        self._require_weights()
        self.model.eval()

        with torch.no_grad():
            out = forward_backward(self.model, micro_batches, reduce=reduce, routes_out=routes_out)
        return [o["output"] for o in out]

    def evaluate(self, micro_batches: List[MicroBatch], loss_fn: LossFn) -> List[Dict[str, Any]]:
        """A forward-only pass with ``loss_fn``: its metrics per micro-batch on the last pipeline
        stage ([] on the others); nothing is trained (validation)."""
        self._require_weights()
        self.model.eval()
        with torch.no_grad():
            return forward_backward(self.model, micro_batches, loss_fn, forward_only=True)

    def train_step(self, micro_batches: List[MicroBatch], loss_fn: LossFn) -> Dict[str, Any]:
        if not self.trainable:
            raise RuntimeError(f"role {self.name} is not trainable")
        self._require_weights()
        self.model.train()
        try:
            result = train_step(self.model, self.optimizer, micro_batches, loss_fn)
        except NoGradientError as e:
            raise NoGradientError(f"{self.name}: {e}") from None
        self.memory.optimizer_stepped()
        return result

    def _require_weights(self) -> None:
        if not self.memory.is_resident(WEIGHTS):
            raise RuntimeError(
                f"role {self.name}: its weights are offloaded; run it inside "
                f"`with role.resident(phase):`"
            )


def _load_weights(model: torch.nn.Module, name: str, config: RLHFConfig) -> None:
    """This rank's shard of the role's ``load`` checkpoint, cut for the role's own layout. A reward
    model trained by stage rm or prm may start from a language model (the SFT policy, as TRL and OpenRLHF
    start theirs): its body, with the score head as seeded (new)."""
    from megatron_rlhf.checkpoint import load_model_shard
    from megatron_rlhf.checkpoint.model_files import read_model_meta

    groups, arch, path = groups_of(model), config.role(name).model, config.path_of(name + ".load")
    new_head = config.stage in ("rm", "prm") and name == "reward" and read_model_meta(path)[1]["head"] == "lm"
    shard = load_model_shard(
        path, arch, "lm" if new_head else ROLE_HEADS[name], groups.tp.size(), groups.tp.rank(),
        groups.pp.size(), groups.pp.rank(), groups.ep.size(), groups.ep.rank(), padded_vocab=config.padded_vocab(arch),
    )
    if new_head:  # the body's weights this stage holds, the seeded score head
        own = local_state_dict(model)
        shard = {k: v for k, v in shard.items() if k in own and k != "output_layer.weight"}
        shard.update({k: v for k, v in own.items() if k == "output_layer.weight"})
    load_local_state_dict(model, shard)


def _load_adapters(model: torch.nn.Module, name: str, config: RLHFConfig) -> None:
    """This rank's shard of the role's ``load_lora`` PEFT adapter into its adapters."""
    from megatron_rlhf.checkpoint.peft import peft_adapters

    groups, role_config = groups_of(model), config.role(name)
    arch = role_config.model
    full = peft_adapters(config.path_of(name + ".load_lora"), role_config.lora, arch)
    load_adapters(model, shard_state_dict(full, arch.num_layers, config.padded_vocab(arch), groups.tp.size(),
                                          groups.tp.rank(), groups.pp.size(), groups.pp.rank(), head=ROLE_HEADS[name]))


def build_role(name: str, config: RLHFConfig) -> Role:
    """Build role ``name`` on this rank (needs init_distributed first).

    Weights come from the role's ``load`` checkpoint (any TP/PP it was written at), else from the
    run's seed, so that roles of one architecture and head start from the same weights, as if
    loaded from one checkpoint: reference equals the initial policy.
    """
    role_config = config.role(name)
    layout = config.layout_of(name)
    set_seed(config.seed)
    model = build_model(
        role_config.model,
        layout,
        ROLE_HEADS[name],
        precision=role_config.precision,
        recompute_activations=role_config.recompute_activations,
        cuda_graph_impl=role_config.cuda_graph_impl,
        attention=role_config.attention,
        logprob_chunk_tokens=config.logprob_chunk_tokens(name),
        pack_rows=role_config.pack_rows,
        pg_collection=(layout_groups(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                                     layout.expert_model_parallel_size) if config.has_own_layout(name) else None),
        padded_vocab=config.padded_vocab(role_config.model),
    )
    if role_config.load is not None:
        _load_weights(model, name, config)
    lora = config.lora_of(name)
    if lora.enabled:
        add_adapters(model, lora.rank, lora.alpha, lora.target_modules, config.seed)
        if role_config.load_lora:
            _load_adapters(model, name, config)
        head = getattr(unwrap(model), "output_layer", None)  # the last pipeline stage's
        if ROLE_HEADS[name] == "scalar" and head is not None:  # a value model's score head trains in full
            head.requires_grad_(True)
    if config.moe.routing_replay != "off" and name in REPLAYING_ROLES:
        routing.enable(model)
    optimizer = None
    if name in config.trainable_roles:
        model, optimizer = wrap_for_training(model, role_config)
    role = assemble_role(name, role_config, model, optimizer)
    role.memory.offload()  # idle from birth: the next role is built with this one off the device
    return role


def assemble_role(name: str, role_config: RoleConfig, model: torch.nn.Module, optimizer: Optional[Any] = None) -> Role:
    """A role around a built model (and optimizer), with its EMS manager set up from the role's switches."""
    memory = RoleMemory(name, model, optimizer, EMSSwitches.from_role_config(role_config))
    return Role(name, role_config, model, optimizer, memory)
