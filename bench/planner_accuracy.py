"""The planner's activation and KV-cache estimates against what a run holds, side by side.

KV cache: the bytes of megatron's StaticInferenceContext tensors after a prefill of B x S tokens.
Activations: the distinct storages autograd keeps for backward during one training forward of a
micro-batch (saved-tensor hooks), plus the logits; this is what a CUDA peak would add to the state,
measured here on CPU. Single process, TP=1, PP=1.

    python bench/planner_accuracy.py            # tiny and a 256-hidden, 4-layer model
"""

import argparse
import os

import torch

from megatron_rlhf.config.schema import ModelArchConfig, ParallelConfig
from megatron_rlhf.memory.planner import activation_bytes, kv_cache_bytes
from megatron_rlhf.models.llama import build_model
from megatron_rlhf.models.training import next_token_loss
from megatron_rlhf.runtime import init_distributed


def measured_kv(model, arch, batch, seq):
    from megatron.core.inference.contexts import StaticInferenceContext

    model.eval()
    ctx = StaticInferenceContext(batch, seq)
    tokens = torch.randint(0, arch.vocab_size, (batch, seq))
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    with torch.no_grad():
        model(tokens, positions, None, inference_context=ctx, runtime_gather_output=True)
    seen, total = set(), 0
    for pair in ctx.key_value_memory_dict.values():
        for t in pair:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def measured_activations(model, arch, batch, seq):
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen and ptr not in params:
            seen.add(ptr)
            total[0] += storage.nbytes()
        return t

    tokens = torch.randint(0, arch.vocab_size, (batch, seq))
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, positions, None)
        loss, _, _ = next_token_loss(out, {"tokens": tokens})
    loss.backward()
    return total[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_distributed(ParallelConfig(1, 1), seed=0)
    models = {
        "tiny (h64, 2 layers)": ModelArchConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                               ffn_hidden_size=128, vocab_size=128, max_position_embeddings=256),
        "h256, 4 layers": ModelArchConfig(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=8,
                                          ffn_hidden_size=688, vocab_size=1000, max_position_embeddings=512),
    }
    print(f"batch {args.batch}, sequence {args.seq}, fp32, TP=1 PP=1")
    print(f"{'model':<22}{'what':<13}{'planned':>12}{'measured':>12}{'planned/measured':>18}")
    for name, arch in models.items():
        model = build_model(arch, ParallelConfig(1, 1), "lm")
        for what, planned, measured in (
            ("kv cache", kv_cache_bytes(arch, args.batch, args.seq, 1, 1, "fp32"), measured_kv(model, arch, args.batch, args.seq)),
            ("activations", activation_bytes(arch, "lm", args.batch, args.seq, 1, 1, "fp32", False, True),
             measured_activations(model, arch, args.batch, args.seq)),
        ):
            print(f"{name:<22}{what:<13}{planned:>12,}{measured:>12,}{planned / measured:>18.3f}")


if __name__ == "__main__":
    main()
