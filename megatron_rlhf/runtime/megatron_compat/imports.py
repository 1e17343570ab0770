"""Importing megatron-core: without torch's compiler where nothing is compiled, and the MoE
router's GEMM bound where transformer-engine is absent."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron_rlhf.runtime.megatron_compat.sites import Site

# What each function here relies on (name -> sites), checked at start-up (megatron_compat.check).
ANCHORS: Dict[str, Tuple[Site, ...]] = {
    "router_without_te": (
        Site("transformer/moe/moe_utils.py", "if te_general_gemm is not None and router_dtype != torch.float64:"),
        Site("transformer/moe/moe_utils.py", "if te_general_gemm is not None and ctx.router_dtype != torch.float64:"),
    ),
}


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
