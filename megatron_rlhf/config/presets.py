"""Architecture presets: the Llama-2, Llama-3.1, Qwen2.5 and Qwen3 models users align, the
mixtures of experts Qwen3-30B-A3B, Qwen3-235B-A22B and Mixtral-8x7B, and a tiny model for CPU tests
and the demo.

Pure data: a role's ``model: {preset: NAME}`` takes these values for every key it does not set;
the family (config/families.py) then fixes the features its models always have. ``preset: auto``
takes them from the converted checkpoint the role starts from (its CHECKPOINT_META_FILE): any model
of a supported family, presets or not.
"""

AUTO = "auto"
# A converted checkpoint's own description (architecture, head, layout): checkpoint/model_files.py writes it.
CHECKPOINT_META_FILE = "megatron_rlhf_model.json"

_LLAMA31_ROPE = dict(rotary_base=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                     rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192)
_QWEN = dict(rotary_base=1000000.0, norm_epsilon=1e-6)

PRESETS = {
    "tiny": dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=128,
        max_position_embeddings=256,
    ),
    "llama2-7b": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=None,
        ffn_hidden_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama2-13b": dict(
        num_layers=40,
        hidden_size=5120,
        num_attention_heads=40,
        num_query_groups=None,
        ffn_hidden_size=13824,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama2-70b": dict(
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_query_groups=8,
        ffn_hidden_size=28672,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama3.1-8b": dict(
        family="llama", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
        ffn_hidden_size=14336, vocab_size=128256, max_position_embeddings=131072, **_LLAMA31_ROPE,
    ),
    "llama3.1-70b": dict(
        family="llama", num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
        ffn_hidden_size=28672, vocab_size=128256, max_position_embeddings=131072, **_LLAMA31_ROPE,
    ),
    "qwen2.5-7b": dict(
        family="qwen2", num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
        ffn_hidden_size=18944, vocab_size=152064, max_position_embeddings=32768, **_QWEN,
    ),
    "qwen2.5-32b": dict(
        family="qwen2", num_layers=64, hidden_size=5120, num_attention_heads=40, num_query_groups=8,
        ffn_hidden_size=27648, vocab_size=152064, max_position_embeddings=32768, **_QWEN,
    ),
    "qwen2.5-72b": dict(
        family="qwen2", num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
        ffn_hidden_size=29568, vocab_size=152064, max_position_embeddings=32768, **_QWEN,
    ),
    "qwen3-8b": dict(
        family="qwen3", num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8, head_dim=128,
        ffn_hidden_size=12288, vocab_size=151936, max_position_embeddings=40960, **_QWEN,
    ),
    "qwen3-32b": dict(
        family="qwen3", num_layers=64, hidden_size=5120, num_attention_heads=64, num_query_groups=8, head_dim=128,
        ffn_hidden_size=25600, vocab_size=151936, max_position_embeddings=40960, **_QWEN,
    ),
    # Mixtures of experts: every layer has experts (ffn_hidden_size is the unused dense width the
    # checkpoints state).
    "qwen3-30b-a3b": dict(
        family="qwen3_moe", num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4, head_dim=128,
        ffn_hidden_size=6144, vocab_size=151936, max_position_embeddings=40960, num_experts=128,
        moe_ffn_hidden_size=768, moe_router_topk=8, moe_norm_topk_prob=True, **_QWEN,
    ),
    "qwen3-235b-a22b": dict(
        family="qwen3_moe", num_layers=94, hidden_size=4096, num_attention_heads=64, num_query_groups=4, head_dim=128,
        ffn_hidden_size=12288, vocab_size=151936, max_position_embeddings=40960, num_experts=128,
        moe_ffn_hidden_size=1536, moe_router_topk=8, moe_norm_topk_prob=True, **_QWEN,
    ),
    "mixtral-8x7b": dict(
        family="mixtral", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
        ffn_hidden_size=14336, vocab_size=32000, max_position_embeddings=32768, num_experts=8,
        moe_ffn_hidden_size=14336, moe_router_topk=2, rotary_base=1000000.0, norm_epsilon=1e-5,
    ),
}
