"""Greedy generation from a converted Hugging Face checkpoint at TP=1, TP=2, PP=2 and TP2xPP2,
on prompts of mixed lengths, fewer decode slots than prompts (slots are refilled), with an EOS
token; also with the EOS learnt 2 steps late. Args: CHECKPOINT_DIR EOS. Run with 4 processes."""

import torch
from common import ARGS, save, setup
from tests.workers.findings import Generated, GenerationVsHF
from megatron.core import parallel_state as ps

from megatron_rlhf.checkpoint import load_model_shard
from megatron_rlhf.checkpoint.model_files import read_model_meta
from megatron_rlhf.generation import SamplingParams, generate
from megatron_rlhf.models.decoder import build_model, load_local_state_dict

LENGTHS = [3, 17, 9, 1, 30, 12, 5, 24]
root, eos = ARGS[0], int(ARGS[1])
arch, meta = read_model_meta(root)
prompts = torch.randint(3, arch.vocab_size, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(0))
for row, n in enumerate(LENGTHS):
    prompts[row, n:] = 0
params = SamplingParams(max_new_tokens=10, greedy=True, eos_ids=(eos,), pad_id=0)
result = GenerationVsHF(prompts=prompts, lengths=LENGTHS, greedy={})
for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
    parallel = setup(tp, pp)
    model = build_model(arch, parallel, "lm")
    load_local_state_dict(model, load_model_shard(root, arch, "lm", tp, ps.get_tensor_model_parallel_rank(), pp,
                                                  ps.get_pipeline_model_parallel_rank()))
    gen = generate(model, prompts, torch.tensor(LENGTHS), params, arch.vocab_size, batch_size=3)
    result.greedy[f"tp{tp}_pp{pp}"] = Generated(tokens=gen.tokens, response_lengths=gen.response_lengths, stats=gen.stats)
    if (tp, pp) == (2, 2):
        late = generate(model, prompts, torch.tensor(LENGTHS), params, arch.vocab_size, batch_size=3, completion_lag=2)
        result.greedy["tp2_pp2_lag2"] = Generated(tokens=late.tokens, response_lengths=late.response_lengths, stats=late.stats)
    del model
save(result)
