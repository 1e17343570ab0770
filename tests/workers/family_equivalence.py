"""Every family's converted checkpoint at TP=2 and at PP=2 (2 processes), and at EP=2 where asked:
full outputs on fixed tokens, and (LM heads) greedy generation of mixed-length prompts with 3
decode slots and an EOS. Args: [--layouts=TP.PP.EP,...] NAME=CHECKPOINT_DIR:EOS,EOS ... (the end
tokens; none for scalar heads). Results are keyed (NAME, tpT_ppP) (and _epE when E > 1)."""

import torch
from common import ARGS, save, setup
from tests.workers.findings import FamilyEquivalence
from megatron.core import parallel_state as ps

from megatron_rlhf.checkpoint import load_model_shard
from megatron_rlhf.checkpoint.model_files import read_model_meta
from megatron_rlhf.generation import SamplingParams, generate
from megatron_rlhf.models.decoder import build_model, load_local_state_dict
from megatron_rlhf.models.pipeline import forward_backward, gather_vocab_parallel

LENGTHS = [3, 17, 9, 1, 30, 12, 5, 24]
tokens = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(0))
prompts = torch.randint(3, 100, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(0))
result = FamilyEquivalence(tokens=tokens, prompts=prompts, lengths=LENGTHS, outputs={}, generated={}, generated_unequal={})
layouts, cases = ((2, 1, 1), (1, 2, 1)), ARGS
if ARGS[0].startswith("--layouts="):
    layouts = [tuple(int(n) for n in layout.split(".")) for layout in ARGS[0].split("=", 1)[1].split(",")]
    cases = ARGS[1:]
for tp, pp, ep in layouts:
    parallel = setup(tp, pp, ep=ep)
    for arg in cases:
        name, rest = arg.split("=", 1)
        root, eos = rest.rsplit(":", 1)
        arch, meta = read_model_meta(root)
        head = meta["head"]
        model = build_model(arch, parallel, head)
        load_local_state_dict(model, load_model_shard(root, arch, head, tp, ps.get_tensor_model_parallel_rank(), pp,
                                                      ps.get_pipeline_model_parallel_rank(), ep,
                                                      ps.get_expert_model_parallel_rank()))
        model.eval()  # scoring, as the serving roles run (megatron refuses MoE training at TP > 1 without SP)
        out = forward_backward(model, [{"tokens": tokens}])
        key = (name, f"tp{tp}_pp{pp}" + (f"_ep{ep}" if ep > 1 else ""))
        if out:
            output = out[0]["output"]
            result.outputs[key] = gather_vocab_parallel(output)[..., : arch.vocab_size] if head == "lm" else output
        if head == "lm":
            params = SamplingParams(max_new_tokens=10, greedy=True, eos_ids=tuple(int(t) for t in eos.split(",") if t), pad_id=0)
            gen = generate(model, prompts, torch.tensor(LENGTHS), params, arch.vocab_size, batch_size=3)
            result.generated[key] = [gen.tokens[r, n : n + int(gen.response_lengths[r])].tolist()
                                     for r, n in enumerate(LENGTHS)]
            if ep > 1:  # replicas with unequal work: rank 1 drains first and keeps its peer's all-to-alls going
                rows = len(LENGTHS) if ps.get_expert_model_parallel_rank() == 0 else 2
                gen = generate(model, prompts[:rows], torch.tensor(LENGTHS[:rows]), params, arch.vocab_size, batch_size=3)
                result.generated_unequal[key] = [gen.tokens[r, n : n + int(gen.response_lengths[r])].tolist()
                                                 for r, n in enumerate(LENGTHS[:rows])]
        del model
save(result)
