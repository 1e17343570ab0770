"""The megatron-core internals the project relies on beyond its public API, by area.

EMS moves DDP's contiguous buffers and the optimizer's shards, PPO checkpoints save each DP rank's
owned part of the distributed optimizer's state, training wires DDP's grad sync into the model config, the generation
engine stands in for megatron's attention, and a serving role at a layout of its own is served by
megatron's resharding. Those pieces are attributes and methods megatron-core does not promise to
keep. Every other module reaches them through the functions here; each area's module holds its
functions beside the ANCHORS they rely on (a megatron-core file and text that must still be in it),
and :func:`check` (run at start-up by ``init_distributed``, on every platform) refuses an installed
megatron-core that moved one, naming each and the module to re-verify.

    ddp.py              DDP's buffers, grad-buffer free and restore, grad-sync hooks, per-token loss
    optimizer.py        optimizer shards, Adam's state, each DP rank's owned state, the unclipped grad norm
    engine.py           attention layers replaced for an engine's steps, RoPE angles and frequencies
    tensor_parallel.py  a parallel linear's local product (or its input kept), cross entropy over another TP group
    resharding.py       the cached plan (receives; a part run alone), SequentialMLP experts' names
    imports.py          importing megatron without torch's compiler, the MoE router's GEMM
    rope.py             megatron's unfused RoPE with its cosines computed once per angle tensor
    sites.py            Site, the check's reading of megatron's files, name replacement in a block
"""

from __future__ import annotations

from typing import Dict, Tuple

from megatron_rlhf.runtime.megatron_compat import ddp, engine, imports, optimizer, resharding, rope, tensor_parallel
from megatron_rlhf.runtime.megatron_compat.ddp import (buffer_grad_storage, buffer_param_storage, buffer_params,
                                                       ddp_buffers, fixed_address_settings, free_grad_buffers,
                                                       restore_grad_buffers, wire_grad_sync)
from megatron_rlhf.runtime.megatron_compat.engine import (attention_layers, attention_replaced, rope_attention_factor,
                                                          rotary_angles, set_rope_attention_factor, set_rope_inv_freq)
from megatron_rlhf.runtime.megatron_compat.imports import bind_router_gemm, import_megatron
from megatron_rlhf.runtime.megatron_compat.optimizer import (adam_state, inner_optimizers, main_param_tensors,
                                                             owned_optimizer_state, param_groups, reload_main_params,
                                                             unclipped_grad_norm)
from megatron_rlhf.runtime.megatron_compat.resharding import (reshard_part, reshard_receives,
                                                              sequential_experts_resharded)
from megatron_rlhf.runtime.megatron_compat.rope import bind_rope
from megatron_rlhf.runtime.megatron_compat.sites import (CHECKED_MEGATRON_CORE_VERSIONS, MegatronInternalsChanged,
                                                         Site, raise_if_changed, site_problems)
from megatron_rlhf.runtime.megatron_compat.tensor_parallel import (column_input_kept, linear_matmuls_replaced,
                                                                   replace_linear_matmuls, vocab_parallel_cross_entropy)

_AREAS = (ddp, optimizer, engine, tensor_parallel, resharding, imports, rope)
# Every area's anchors by name (the check reads this table, so that a test can move one).
ANCHORS: Dict[str, Tuple[Site, ...]] = {name: sites for area in _AREAS for name, sites in area.ANCHORS.items()}
_AREA_OF = {name: area.__name__.rsplit(".", 1)[-1] for area in _AREAS for name in area.ANCHORS}


def check() -> None:
    """Refuse a megatron-core whose internals used here have moved."""
    problems = site_problems(ANCHORS.items())
    areas = sorted({_AREA_OF[p.split(":", 1)[0]] for p in problems if p.split(":", 1)[0] in _AREA_OF})
    raise_if_changed(problems, "megatron_rlhf's uses of its internals",
                     ", ".join(f"megatron_rlhf/runtime/megatron_compat/{a}.py" for a in areas) or "megatron_rlhf/runtime/megatron_compat")


__all__ = [
    "ANCHORS", "CHECKED_MEGATRON_CORE_VERSIONS", "MegatronInternalsChanged", "Site", "adam_state", "attention_layers",
    "attention_replaced", "bind_rope", "bind_router_gemm", "buffer_grad_storage", "buffer_param_storage", "buffer_params", "check",
    "column_input_kept", "ddp_buffers", "fixed_address_settings", "free_grad_buffers", "import_megatron", "inner_optimizers",
    "linear_matmuls_replaced", "replace_linear_matmuls", "main_param_tensors", "param_groups", "raise_if_changed", "reload_main_params",
    "reshard_part", "reshard_receives", "restore_grad_buffers", "rope_attention_factor", "rotary_angles", "owned_optimizer_state",
    "sequential_experts_resharded", "set_rope_attention_factor", "set_rope_inv_freq", "site_problems", "unclipped_grad_norm",
    "vocab_parallel_cross_entropy", "wire_grad_sync",
]
