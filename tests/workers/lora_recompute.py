"""One training step of LoRA adapters on the tiny model with megatron's full activation recompute
on and off (the base frozen, the same adapters), fp32: every adapter's gradient and the step's norm;
and the step with recompute as it was before its fix (the embeddings' output needing no gradient):
what the training pass says."""

import torch
from common import save, setup, tiny_arch
from tests.workers.findings import LoRARecompute

from megatron_rlhf.config.names import LORA_TARGETS
from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.models.decoder import build_model, unwrap
from megatron_rlhf.errors import NoGradientError
from megatron_rlhf.models import lora
from megatron_rlhf.models.lora import add_adapters, is_adapter
from megatron_rlhf.models.training import next_token_loss, train_step, wrap_for_training

arch = tiny_arch()
tokens = torch.randint(0, arch.vocab_size, (4, 12), generator=torch.Generator().manual_seed(2))


def step(recompute: bool):
    parallel = setup(1, 1, seed=5)
    model = build_model(arch, parallel, "lm", precision="fp32", recompute_activations=recompute)
    add_adapters(model, 4, 8.0, LORA_TARGETS, seed=5)
    for name, p in unwrap(model).named_parameters():
        if name.endswith("lora_b"):  # B = 0 at the start gives A no gradient: a B of its own makes both learn
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    ddp, optimizer = wrap_for_training(model, RoleConfig(precision="fp32", lr=1e-3, recompute_activations=recompute))
    result = train_step(ddp, optimizer, [{"tokens": tokens[:2]}, {"tokens": tokens[2:]}], next_token_loss)
    grads = {n: p.main_grad.detach().clone() for n, p in unwrap(ddp).named_parameters() if is_adapter(n)}
    return grads, float(result["grad_norm"])


runs = {"off": step(False), "on": step(True)}
fixed, lora._output_requires_grad = lora._output_requires_grad, lambda module, inputs, output: None
try:
    step(True)
    unfixed = "trained"
except NoGradientError as e:
    unfixed = str(e)
finally:
    lora._output_requires_grad = fixed
save(LoRARecompute(grads={k: g for k, (g, _) in runs.items()}, grad_norms={k: n for k, (_, n) in runs.items()},
                   unfixed=unfixed))
