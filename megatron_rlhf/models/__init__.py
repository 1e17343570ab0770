"""Llama-2 style Megatron models: builders, heads, presets, sharding and the training wrapper.

Submodules import megatron-core lazily so that config and planning tools work without building
anything; import from the submodules (llama, sharding, pipeline, training, presets).
"""
