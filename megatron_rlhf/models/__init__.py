"""Megatron GPT models of every supported family (dense and mixtures of experts): builders, heads,
sharding, pipelines, routing replay, LoRA adapters and the training wrapper.

Submodules import megatron-core lazily so that config and planning tools work without building
anything; import from the submodules (decoder, sharding, pipeline, training, routing, lora).
"""
