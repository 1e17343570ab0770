"""The megatron-core internals the project relies on beyond its public API, in one place.

EMS moves DDP's contiguous buffers and the optimizer's shards, PPO checkpoints save the distributed
optimizer's DP-zero state, and training wires DDP's grad sync into the model config. Those pieces
are attributes and methods megatron-core does not promise to keep. Every other module reaches them
through the functions here; :data:`ANCHORS` names the megatron-core file each relies on and text
that must still be in it, and :func:`check` (run at start-up by ``init_distributed``, on every
platform) refuses an installed megatron-core that moved one, naming each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

CHECKED_MEGATRON_CORE_VERSIONS = ("0.16.1",)


class MegatronInternalsChanged(RuntimeError):
    """The installed megatron-core no longer matches the internals this project was written for."""


@dataclasses.dataclass(frozen=True)
class Site:
    """Text that must appear in a megatron-core file (relative to megatron/core), within the
    1-based inclusive line range ``lines`` when given, else anywhere in the file."""

    file: str
    anchor: str
    lines: Optional[Tuple[int, int]] = None


# What each use relies on (name -> sites).
ANCHORS: Dict[str, Tuple[Site, ...]] = {
    "ddp_buffers": (
        Site("distributed/distributed_data_parallel.py", "self.buffers"),
        Site("distributed/distributed_data_parallel.py", "self.expert_parallel_buffers"),
        Site("distributed/param_and_grad_buffer.py", "self.param_data"),
        Site("distributed/param_and_grad_buffer.py", "self.grad_data"),
        Site("distributed/param_and_grad_buffer.py", "self.params"),
    ),
    "fixed_address_settings": (
        Site("transformer/transformer_config.py", "cuda_graph_impl: Literal['none', 'local', 'transformer_engine']"),
        Site("distributed/distributed_data_parallel_config.py", "nccl_ub: bool = False"),
        Site("distributed/distributed_data_parallel_config.py", "overlap_param_gather: bool = False"),
    ),
    "grad_buffer_free_and_restore": (
        Site("distributed/distributed_data_parallel.py", "def offload_grad_buffers("),
        Site("distributed/distributed_data_parallel.py", "def restore_grad_buffers("),
    ),
    "optimizer_shards": (
        Site("optimizer/optimizer.py", "self.chained_optimizers"),
        Site("optimizer/optimizer.py", "self.fp32_from_float16_groups"),
        Site("optimizer/distrib_optimizer.py", "self.shard_fp32_from_float16_groups"),
    ),
    "grad_norm": (
        Site("optimizer/optimizer.py", "def get_grad_norm("),
        Site("optimizer/optimizer.py", "if self.config.clip_grad > 0.0:"),
    ),
    "per_token_loss": (
        Site("pipeline_parallel/schedules.py", "output_tensor, num_tokens, loss_reduced = outputs"),
        Site("distributed/finalize_model_grads.py", "torch.distributed.all_reduce(num_tokens, group=dp_cp_group)"),
        Site("distributed/distributed_data_parallel.py", "if not config.calculate_per_token_loss:"),
    ),
    "dp_zero_optimizer_checkpoint": (
        Site("optimizer/distrib_optimizer.py", "def save_parameter_state("),
        Site("optimizer/distrib_optimizer.py", "def load_parameter_state_from_dp_zero("),
        Site("optimizer/distrib_optimizer.py", "if self.data_parallel_group.rank() == 0:\n            state_dict = torch.load(filename)"),
        Site("optimizer/optimizer.py", "state_dict = states[idx] if states else None"),
        Site("optimizer/optimizer.py", "def reload_model_params("),
    ),
    "engine_attention": (
        Site("transformer/transformer_layer.py", "attention_output_with_bias = self.self_attention("),
        Site("transformer/attention.py", "def get_query_key_value_tensors("),
        Site("transformer/attention.py", "output, bias = self.linear_proj(core_attn_out)"),
        Site("transformer/transformer_block.py", "self.layers = torch.nn.ModuleList("),
        Site("models/gpt/gpt_model.py", "self.rotary_pos_emb = RotaryEmbedding("),
        Site("models/gpt/gpt_model.py", "hidden_states = self.decoder("),
    ),
    "linear_matmul": (  # each parallel linear's local product, looked up on the module at call time
        Site("tensor_parallel/layers.py", "def _forward_impl(self, input, weight, *args, **kwargs):"),
        Site("tensor_parallel/layers.py", "output_parallel = self._forward_impl(\n            input=input_parallel,"),
    ),
    "rope_frequencies": (  # megatron's llama3 scaling fixes its bounds; scaled models set their own
        Site("models/common/embeddings/rotary_pos_embedding.py", "self.inv_freq = 1.0 / ("),
        Site("models/common/embeddings/rotary_pos_embedding.py", "freqs = torch.outer(seq, self.inv_freq)"),
        Site("models/common/embeddings/rotary_pos_embedding.py", "@lru_cache(maxsize=32)"),
    ),
    "router_without_te": (
        Site("transformer/moe/moe_utils.py", "if te_general_gemm is not None and router_dtype != torch.float64:"),
        Site("transformer/moe/moe_utils.py", "if te_general_gemm is not None and ctx.router_dtype != torch.float64:"),
    ),
    "cross_entropy_tp_group": (  # reads the global TP group; a model of its own layout passes its own
        Site("tensor_parallel/cross_entropy.py", "group=get_tensor_model_parallel_group()"),
        Site("tensor_parallel/cross_entropy.py", "rank = get_tensor_model_parallel_rank()"),
        Site("tensor_parallel/cross_entropy.py", "world_size = get_tensor_model_parallel_world_size()"),
    ),
    "reshard_plan": (  # the plan megatron's resharding caches on the target model (its transfers)
        Site("resharding/refit.py", 'setattr(tgt_core, "_cached_reshard_plan", plan)'),
        Site("resharding/utils.py", "my_slice: tuple[slice, ...]"),
        Site("resharding/utils.py", "@dataclass\nclass ReshardPlan:"),
        Site("resharding/refit.py", "execute_reshard_plan(plan, src_core, tgt_core, service=service)"),
    ),
    "reshard_sequential_experts": (  # resharding names experts globally for TEGroupedMLP's weightK only
        Site("resharding/utils.py", "def assign_ep_resolved_name_inplace("),
        Site("resharding/utils.py", "local_idx = _detect_expert_index_from_param_name(base)"),
        Site("resharding/utils.py", "assign_ep_resolved_name_inplace(meta, base_name=name)"),
    ),
    "grad_sync_hooks": (
        Site("model_parallel_config.py", "finalize_model_grads_func"),
        Site("model_parallel_config.py", "no_sync_func"),
        Site("model_parallel_config.py", "grad_sync_func"),
    ),
}


def megatron_core_dir() -> str:
    import megatron.core

    return os.path.dirname(megatron.core.__file__)


def site_problems(named_sites: Iterable[Tuple[str, Iterable[Site]]]) -> List[str]:
    """Every site whose anchor is no longer where it should be, as readable problems."""
    root = megatron_core_dir()
    problems: List[str] = []
    cache: Dict[str, List[str]] = {}
    for name, sites in named_sites:
        for site in sites:
            if site.file not in cache:
                try:
                    with open(os.path.join(root, site.file), encoding="utf-8") as f:
                        cache[site.file] = f.read().splitlines()
                except OSError as e:
                    problems.append(f"{name}: cannot read megatron/core/{site.file}: {e}")
                    cache[site.file] = []
                    continue
            lines = cache[site.file]
            first, last = site.lines or (1, len(lines))
            if site.anchor not in "\n".join(lines[first - 1 : last]):
                where = f" lines {first}-{last}" if site.lines else ""
                problems.append(f"{name}: expected {site.anchor!r} in megatron/core/{site.file}{where}")
    return problems


def raise_if_changed(problems: List[str], what: str, module: str) -> None:
    if problems:
        version = importlib.metadata.version("megatron-core")
        raise MegatronInternalsChanged(
            f"megatron-core {version} differs from the internals {what} were written for (checked: "
            f"{', '.join(CHECKED_MEGATRON_CORE_VERSIONS)}). Re-verify each in {module}:\n  "
            + "\n  ".join(problems)
        )


def check() -> None:
    """Refuse a megatron-core whose internals used here have moved."""
    raise_if_changed(site_problems(ANCHORS.items()), "megatron_rlhf's uses of its internals",
                     "megatron_rlhf/runtime/megatron_compat.py")


def import_megatron(compiles_kernels: bool) -> None:
    """Import megatron-core. Its ``@jit_fuser`` kernels (SwiGLU, GeGLU, a MoE router's bookkeeping)
    are wrapped in ``torch.compile`` when megatron.core.jit is imported, which loads torch's compiler
    (dynamo, inductor: about 1.2 s of a 3 s import on CPU). Where the fusions are off and nothing is
    compiled (``compiles_kernels`` False: CPU), megatron.core.jit binds a plain decorator instead, so
    the functions run as written. A process that already imported megatron keeps its binding."""
    import sys

    if compiles_kernels or "megatron.core.jit" in sys.modules:
        import megatron.core  # noqa: F401
        return
    real = torch.compile
    torch.compile = _as_written  # what megatron.core.jit binds jit_fuser to while it is imported
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = real


def _as_written(function=None, **_):
    return function if function is not None else (lambda f: f)


def bind_router_gemm() -> None:
    """megatron's MoE router reads ``te_general_gemm``, which is bound only when transformer-engine
    imports (a NameError at the first routed token otherwise); None sends it to its torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# --------------------------------------------------------------------------------------------------
# DDP's contiguous buffers


def ddp_buffers(model: torch.nn.Module) -> list:
    """megatron DDP's _ParamAndGradBuffers (none for a model without DDP)."""
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return []
    return list(model.buffers) + list(model.expert_parallel_buffers)


def fixed_address_settings(model: torch.nn.Module) -> List[str]:
    """The settings of a built model that need its device storages never to move: CUDA graphs,
    NCCL user buffers, the all-gather of updated weights deferred to the next forward."""
    from megatron.core.distributed import DistributedDataParallel

    found = []
    config = getattr(model, "config", None)  # megatron modules (DDP, Float16Module, GPTModel) carry theirs
    if getattr(config, "cuda_graph_impl", "none") != "none" or getattr(config, "enable_cuda_graph", False):
        found.append(f"cuda_graph_impl={getattr(config, 'cuda_graph_impl', 'local')!r}")
    if isinstance(model, DistributedDataParallel):
        found += [f"{key}=True" for key in ("nccl_ub", "overlap_param_gather") if getattr(model.ddp_config, key)]
    return found


def buffer_param_storage(buffer) -> Optional[torch.Tensor]:
    """The contiguous parameter buffer (only with the distributed optimizer), else None."""
    return buffer.param_data


def buffer_params(buffer) -> list:
    return list(buffer.params)


def buffer_grad_storage(buffer) -> Optional[torch.Tensor]:
    return buffer.grad_data


def free_grad_buffers(ddp_model) -> None:
    """Resize DDP's grad buffers to 0; every main_grad view stays valid (megatron's own method)."""
    ddp_model.offload_grad_buffers(synchronize=True, empty_cache=False)


def restore_grad_buffers(ddp_model) -> None:
    """Grow DDP's grad buffers back, zeroed."""
    ddp_model.restore_grad_buffers(synchronize=False)


def wire_grad_sync(model_config, ddp_model, overlap_grad_reduce: bool) -> None:
    """Let megatron's schedule finalise grads and manage DDP's grad sync for this model."""
    from megatron.core.distributed import finalize_model_grads

    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.no_sync_func = ddp_model.no_sync
    if overlap_grad_reduce:
        model_config.grad_sync_func = ddp_model.start_grad_sync


# --------------------------------------------------------------------------------------------------
# The optimizer's state


def inner_optimizers(optimizer) -> List:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def main_param_tensors(inner) -> List[torch.Tensor]:
    """fp32 master copies of low-precision weights (distributed-optimizer shards or full copies)."""
    groups = getattr(inner, "shard_fp32_from_float16_groups", None) or getattr(inner, "fp32_from_float16_groups", None) or []
    return [t for group in groups for t in group]


def adam_state(inner) -> Dict:
    """torch.optim state of one megatron optimizer: parameter -> {exp_avg, exp_avg_sq, step}."""
    return inner.optimizer.state


def save_dp_zero_state(optimizer, path: str) -> None:
    """The distributed optimizer's shards gathered over DP (DP rank 0 writes; collective)."""
    optimizer.save_parameter_state(path)


def load_dp_zero_state(optimizer, path: str) -> None:
    """The inverse of save_dp_zero_state, as megatron's load_parameter_state (one state dict for a
    single optimizer, a list for a chain; read on DP rank 0 and scattered), but read to the CPU
    whatever device wrote it (megatron's own loader has no map_location)."""
    inners = inner_optimizers(optimizer)
    states = None
    for index, inner in enumerate(inners):
        if getattr(inner, "is_stub_optimizer", False) or not hasattr(inner, "load_parameter_state_from_dp_zero"):
            continue
        if inner.data_parallel_group.rank() == 0 and states is None:
            states = torch.load(path, map_location="cpu", weights_only=False)
        state = None if states is None else (states if len(inners) == 1 else states[index])
        inner.load_parameter_state_from_dp_zero(state)


def unclipped_grad_norm(optimizer) -> float:
    """The global grad norm of the step just taken, for an optimizer that did not clip (megatron
    computes it only when clip_grad > 0); the main grads are still in place after the step."""
    return float(optimizer.get_grad_norm())


def reload_main_params(optimizer) -> None:
    """Copy freshly loaded model weights into the optimizer's fp32 main params."""
    optimizer.reload_model_params()


# --------------------------------------------------------------------------------------------------
# The generation engine's seam: megatron's attention layers, replaced for the steps of an engine


@contextlib.contextmanager
def _module_names_replaced(module, **replacements):
    """Within the block, ``module``'s names point at ``replacements`` (functions megatron looks up
    in its module at call time); afterwards they are megatron's again."""
    saved = {name: getattr(module, name) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None) -> torch.Tensor:
    """megatron's vocab-parallel cross entropy over ``tp_group`` (default: the run's TP group).
    megatron's reads the global TP group, its rank and size in its forward (the backward needs
    none): for another group they are pointed at it for the call."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import cross_entropy

    if tp_group is None or tp_group is parallel_state.get_tensor_model_parallel_group():
        return cross_entropy.vocab_parallel_cross_entropy(logits, target)
    with _module_names_replaced(cross_entropy, get_tensor_model_parallel_group=lambda *a, **k: tp_group,
                                get_tensor_model_parallel_rank=lambda *a, **k: tp_group.rank(),
                                get_tensor_model_parallel_world_size=lambda *a, **k: tp_group.size()):
        return cross_entropy.vocab_parallel_cross_entropy(logits, target)


def reshard_receives(gpt_model: torch.nn.Module) -> List[Tuple[str, tuple]]:
    """(parameter name, slice) of every receive this rank makes when megatron's resharding serves
    ``gpt_model`` (from the plan it cached on the model's first resharding; [] before)."""
    plan = getattr(gpt_model, "_cached_reshard_plan", None)
    return [] if plan is None else [(op.param_name, op.my_slice) for op in plan.recv_ops]


def reshard_part(src: torch.nn.Module, dst: torch.nn.Module, service, keep: Callable[[str], bool]) -> None:
    """Run only the transfers of the parameters ``keep`` names, from the plan megatron's resharding
    cached on ``dst`` at its first (whole) resharding; collective as that is."""
    from megatron.core.resharding import execute_reshard_plan

    plan = dst._cached_reshard_plan
    part = dataclasses.replace(plan, send_ops=[op for op in plan.send_ops if keep(op.param_name)],
                               recv_ops=[op for op in plan.recv_ops if keep(op.param_name)])
    execute_reshard_plan(part, src, dst, service=service)


def sequential_experts_resharded():
    """megatron's resharding matches an expert's parameters across EP layouts by a global expert
    index it reads only from TEGroupedMLP's names (``weight3``); SequentialMLP's experts
    (``local_experts.3.linear_fc1.weight``, the layout used here) would be matched by their local
    index and refused. Within the block, such names get the global index too: EP rank r of E holds
    experts r * (N / E) ... (r + 1) * (N / E) - 1, as megatron places them."""
    from megatron.core.resharding import utils

    original = utils.assign_ep_resolved_name_inplace

    def resolved(meta, *, base_name=None):
        original(meta, base_name=base_name)
        parts = meta.resolved_name.split(".")
        if not meta.is_ep or meta.global_expert_index is not None or "local_experts" not in parts:
            return
        at = parts.index("local_experts") + 1
        ranks = meta.expert_parallel_group_ranks
        meta.global_expert_index = ranks.index(meta.owner_rank) * (meta.num_experts // len(ranks)) + int(parts[at])
        parts[at] = str(meta.global_expert_index)
        meta.resolved_name = ".".join(parts)

    return _module_names_replaced(utils, assign_ep_resolved_name_inplace=resolved)


def attention_layers(gpt_model: torch.nn.Module) -> List[torch.nn.Module]:
    """The SelfAttention module of each transformer layer of this stage, in order."""
    return [layer.self_attention for layer in gpt_model.decoder.layers]


@contextlib.contextmanager
def _methods_replaced(modules: List[torch.nn.Module], name: str, make: Callable[[int, torch.nn.Module], Callable]):
    """Within the block, module i's method ``name`` is ``make(i, module)`` (an attribute of the
    instance, which its class's method looks up at call time); afterwards the class's again."""
    try:
        for i, module in enumerate(modules):
            setattr(module, name, make(i, module))
        yield
    finally:
        for module in modules:
            module.__dict__.pop(name, None)


def attention_replaced(gpt_model: torch.nn.Module, make_forward: Callable[[int, torch.nn.Module], Callable]):
    """Within the block, layer i's attention runs ``make_forward(i, attention)(hidden_states,
    **megatron's arguments)`` instead of its own forward (which must return (output, bias))."""
    return _methods_replaced(attention_layers(gpt_model), "forward", make_forward)


def linear_matmuls_replaced(model: torch.nn.Module, matmul: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]):
    """Within the block, every column- and row-parallel linear of ``model`` computes its local
    product as ``matmul(input, weight, bias)`` (megatron still does the TP communication around
    it), except where megatron gathers a sequence-parallel input inside the product: there its own."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    def local_product(_, linear):
        megatron_own = linear._forward_impl

        def forward_impl(input, weight, bias, sequence_parallel=False, **rest):
            if sequence_parallel:
                return megatron_own(input=input, weight=weight, bias=bias, sequence_parallel=True, **rest)
            return matmul(input, weight, bias)
        return forward_impl

    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    return _methods_replaced(linears, "_forward_impl", local_product)


def rotary_angles(gpt_model: torch.nn.Module, length: int) -> torch.Tensor:
    """The model's RoPE angles for positions 0..length-1: [length, 1, 1, rotary dim]."""
    return gpt_model.rotary_pos_emb(length)


def set_rope_inv_freq(gpt_model: torch.nn.Module, inv_freq: torch.Tensor) -> None:
    """Replace the RoPE frequencies of a model not yet run (its embedding caches by length)."""
    rope = gpt_model.rotary_pos_emb
    rope.inv_freq = inv_freq.to(rope.inv_freq.device)
    rope.forward.cache_clear()
