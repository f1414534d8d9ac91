"""The decoder, top to bottom: RoPE tables, attention (reference and fast path), the
building blocks, the decoder families, and the static decode step (CUDA graph / compile).

May import :mod:`runtime.cache`, :mod:`runtime.kernels`, :mod:`runtime.config` and the base
modules; never :mod:`runtime.weights` (the loader hands it a state dict), never Qt.
"""
