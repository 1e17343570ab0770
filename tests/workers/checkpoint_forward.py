"""Load Megatron model checkpoints into models at layout (TP, PP) and return their full outputs on
fixed tokens. Args: CHECKPOINT_DIR [CHECKPOINT_DIR ...] TP PP."""

import torch
from common import ARGS, save, setup
from tests.workers.findings import CheckpointForward
from megatron.core import parallel_state as ps

from megatron_rlhf.checkpoint import load_model_shard
from megatron_rlhf.checkpoint.model_files import read_model_meta
from megatron_rlhf.models.decoder import build_model, load_local_state_dict
from megatron_rlhf.models.pipeline import forward_backward, gather_vocab_parallel

roots, tp, pp = ARGS[:-2], int(ARGS[-2]), int(ARGS[-1])
parallel = setup(tp, pp)
tokens = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
outputs = {}
for root in roots:
    arch, meta = read_model_meta(root)
    model = build_model(arch, parallel, meta["head"])
    load_local_state_dict(model, load_model_shard(root, arch, meta["head"], tp, ps.get_tensor_model_parallel_rank(), pp,
                                                  ps.get_pipeline_model_parallel_rank()))
    out = forward_backward(model, [{"tokens": tokens}])
    output = out[0]["output"] if out else None
    if output is not None and meta["head"] == "lm":
        output = gather_vocab_parallel(output)[..., : arch.vocab_size]
    outputs[root] = output
save(CheckpointForward(tokens=tokens, outputs=outputs))
