"""The inference engine that prefill, decode and mixed workers all run.

Layers, one-way (each imports only those above it):
``params``/``sequence`` (plain data) <- ``block_manager`` <- ``scheduler`` (no torch)
<- ``sampler``, ``model_runner`` (own the tensors) <- ``llm_engine`` <- ``llm`` (offline API).
``surface`` holds the value objects servers may see of an engine (capacity, load, KV view,
reservations), so nothing outside reaches into the scheduler or the runner.
"""
