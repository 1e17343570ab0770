"""Every family's converted checkpoint at TP=2 and at PP=2 (2 processes): full outputs on fixed
tokens, and (LM heads) greedy generation of mixed-length prompts with 3 decode slots and an EOS.
Args: NAME=CHECKPOINT_DIR:EOS,EOS ... (the end tokens; none for scalar heads)."""

import torch
from common import ARGS, save, setup
from megatron.core import parallel_state as ps

from megatron_rlhf.checkpoint import load_model_shard
from megatron_rlhf.checkpoint.model_files import read_model_meta
from megatron_rlhf.generation import SamplingParams, generate
from megatron_rlhf.models.decoder import build_model, load_local_state_dict
from megatron_rlhf.models.pipeline import forward_backward, gather_vocab_parallel

LENGTHS = [3, 17, 9, 1, 30, 12, 5, 24]
tokens = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(0))
prompts = torch.randint(3, 100, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(0))
result = {"tokens": tokens, "prompts": prompts, "lengths": LENGTHS}
for tp, pp in ((2, 1), (1, 2)):
    parallel = setup(tp, pp)
    for arg in ARGS:
        name, rest = arg.split("=", 1)
        root, eos = rest.rsplit(":", 1)
        arch, meta = read_model_meta(root)
        head = meta["head"]
        model = build_model(arch, parallel, head)
        load_local_state_dict(model, load_model_shard(root, arch, head, tp, ps.get_tensor_model_parallel_rank(), pp,
                                                      ps.get_pipeline_model_parallel_rank()))
        out = forward_backward(model, [{"tokens": tokens}])
        key = f"{name}/tp{tp}_pp{pp}"
        if out:
            output = out[0]["output"]
            result[key] = gather_vocab_parallel(output)[..., : arch.vocab_size] if head == "lm" else output
        if head == "lm":
            params = SamplingParams(max_new_tokens=10, greedy=True, eos_ids=tuple(int(t) for t in eos.split(",") if t), pad_id=0)
            gen = generate(model, prompts, torch.tensor(LENGTHS), params, arch.vocab_size, batch_size=3)
            result[key + "/generated"] = [gen.tokens[r, n : n + int(gen.response_lengths[r])].tolist()
                                          for r, n in enumerate(LENGTHS)]
        del model
save(result)
