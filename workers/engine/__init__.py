"""The inference engine that prefill, decode and mixed workers all run.

Layers, one-way (each imports only those above it):
``params``/``sequence`` (plain data) <- ``block_manager`` <- ``scheduler`` (no torch)
<- ``sampler``, ``model_runner`` (own the tensors) <- ``llm_engine`` <- ``llm`` (offline API).
"""
