"""TP=1 on this process's platform from one set of weights: fp32 on CPU writes the reference (its
weights, per-token log-probs, greedy tokens with the fp32 margin of every choice, training losses);
bf16 on CUDA loads those weights (ARGS[0]: the CPU run's rank0.pt) and computes the same."""

import torch
from common import ARGS, save, setup, tiny_arch
from tests.workers.findings import GPUvsCPU

from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.generation import SamplingParams, generate
from megatron_rlhf.models.decoder import build_model, load_local_state_dict, local_state_dict
from megatron_rlhf.models.training import next_token_loss, train_step, wrap_for_training
from megatron_rlhf.runtime import get_platform

parallel = setup(1, 1)
platform = get_platform()
reference = torch.load(ARGS[0], weights_only=False) if ARGS else None
precision = "bf16" if reference is not None else "fp32"
arch = tiny_arch(hidden_size=256, ffn_hidden_size=688, num_attention_heads=8, num_query_groups=4, num_layers=4,
                 vocab_size=1000, max_position_embeddings=128)
model = build_model(arch, parallel, "lm", precision=precision)
if reference is not None:
    load_local_state_dict(model, {k: v.to(platform.device) for k, v in reference.weights.items()})
device = platform.device
gen = torch.Generator().manual_seed(3)
tokens = torch.randint(3, arch.vocab_size, (4, 32), generator=gen).to(device)
positions = torch.arange(32, device=device).expand(4, 32)


def log_probs(seq: torch.Tensor) -> torch.Tensor:
    """[b, s, vocab] fp32 log-probs of the next token at every position."""
    with torch.no_grad():
        logits = model(seq, torch.arange(seq.shape[1], device=device).expand_as(seq), None)
    return torch.log_softmax(logits.float()[..., : arch.vocab_size], dim=-1)


model.eval()
result = GPUvsCPU.to_fill()
result.precision, result.device = precision, platform.name
result.token_log_probs = log_probs(tokens)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1).cpu()
prompts = tokens[:, :8]
rows = generate(model, prompts, torch.full((4,), 8), SamplingParams(16, greedy=True), arch.vocab_size).tokens
result.greedy = rows[:, 8:].cpu()
if reference is None:
    # How far the chosen token led the runner-up at every generated position (teacher-forced).
    top2 = log_probs(rows)[:, 7:-1].topk(2, dim=-1).values
    result.margins = (top2[..., 0] - top2[..., 1]).cpu()
    result.weights = {k: v.detach().cpu().clone() for k, v in local_state_dict(model).items()}

model, optimizer = wrap_for_training(model, RoleConfig(precision=precision, lr=1e-3))
model.train()

losses = []
for step in range(4):
    batch = torch.randint(3, arch.vocab_size, (2, 24), generator=gen).to(device)
    metrics = train_step(model, optimizer, [{"tokens": batch}], next_token_loss)["metrics"]
    losses.append(metrics[0]["loss"].item())
result.losses = losses
save(result)
