"""The Python packages the GPU machine lacks, pinned to the versions this checkout's .venv runs.

The GPU machine has Python 3.12 and a CUDA build of torch (with torch's own dependencies) and
nothing else of ours. This walks the installed requirements from ROOTS, leaves out torch and
everything torch itself requires, and prints one ``name==version`` per line for prepare.sh.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement

# What the kit runs: the package (setup.py's install_requires without tensorboard: run.sh turns
# TensorBoard off, and its server and gRPC wheels alone would take a third of the 64 MiB), the
# tests (pytest) and the comparisons against transformers.
ROOTS = ("megatron-core", "pyyaml", "psutil", "numpy", "tokenizers", "tqdm", "safetensors", "transformers", "pytest")
# The peer of the kit's GRPO step (bench/peer_trl.py --device cuda), less what the GPU machine's
# image already holds and would not fit in the 64 MiB: pyarrow and pandas with pandas' own needs.
PEER_ROOTS = ("trl",)
ON_THE_GPU_IMAGE = frozenset({"pyarrow", "pandas", "python-dateutil", "tzdata"})


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots) -> dict:
    """name -> installed version of ``roots`` and all they require (markers of this interpreter)."""
    found, stack = {}, [(r, ("",)) for r in roots]
    while stack:
        name, extras = stack.pop()
        if canonical(name) in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            sys.exit(f"{name} is not installed in {sys.prefix}: run `make install` first")
        found[canonical(name)] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
                stack.append((req.name, tuple(req.extras) or ("",)))
    return found


if __name__ == "__main__":
    provided_by_torch = closure(["torch"])
    ours = closure(ROOTS)
    peer = {name: v for name, v in closure(PEER_ROOTS).items() if name not in ON_THE_GPU_IMAGE}
    for name, version in sorted({**peer, **ours}.items()):
        if name not in provided_by_torch:
            print(f"{name}=={version}")
