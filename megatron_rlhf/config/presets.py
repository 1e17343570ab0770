"""Architecture presets (Llama-2 family and a tiny model for CPU tests and the demo).

Pure data: a role's ``model: {preset: NAME}`` takes these values for every key it does not set.
"""

LLAMA_PRESETS = {
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
}
