"""Run with 2 processes (TP=2). (1) The TP ranks' sampling streams are forced apart (each
seeded differently): the sampled tokens must still be identical on both ranks. (2) A training step with
clip_grad 0 reports the real grad norm (that of the same step with a clip that never bites)."""

import torch
from common import save, setup, tiny_arch
from tests.workers.findings import PPOEdgeCases
from megatron.core import parallel_state as ps

from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.generation import SamplingParams, generate
from megatron_rlhf.models.decoder import build_model
from megatron_rlhf.models.training import next_token_loss, train_step, wrap_for_training

arch = tiny_arch()
parallel = setup(2, 1, seed=3)

model = build_model(arch, parallel, "lm")
prompts = torch.randint(3, arch.vocab_size, (4, 6), generator=torch.Generator().manual_seed(0))
diverged = torch.arange(4) + 100 * ps.get_tensor_model_parallel_rank()
params = SamplingParams(max_new_tokens=12, temperature=1.0, pad_id=0)
tokens = generate(model, prompts, torch.tensor([6, 4, 5, 2]), params, arch.vocab_size, diverged).tokens
everyone = [torch.empty_like(tokens) for _ in range(2)]
torch.distributed.all_gather(everyone, tokens, group=ps.get_tensor_model_parallel_group())
tp_ranks_agree = torch.equal(everyone[0], everyone[1])

batch = [{"tokens": torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))}]
norms = {}
for clip in (0.0, 1e9):
    setup(2, 1, seed=3)
    ddp, optimizer = wrap_for_training(build_model(arch, parallel, "lm"), RoleConfig(precision="fp32", clip_grad=clip))
    norms[clip] = float(train_step(ddp, optimizer, batch, next_token_loss)["grad_norm"])
save(PPOEdgeCases(tp_ranks_agree=tp_ranks_agree, grad_norms=norms))
