"""Matrix-product kernels for the decoder's linear layers, chosen by timing them on this
machine, and the thread counts the CPU runs them on.

- :mod:`runtime.kernels.cpu`: the candidate kernels (one table, :data:`KERNELS`).
- :mod:`runtime.kernels.machine`: the machine a choice is kept for (CPU facts, the key, the file).
- :mod:`runtime.kernels.chooser`: the one chooser (kept for this machine, else measured and kept).
- :mod:`runtime.kernels.choice`: which kernel per phase and weight dtype (float matrices).
- :mod:`runtime.kernels.quant_choice`: which kernel pair per block type (a GGUF's blocks).
- :mod:`runtime.kernels.onednn`: oneDNN's inner product, probed per dtype.
- :mod:`runtime.kernels.threads`: thread governors that pick a count per step by timing.

May import torch and the base modules; never the decoder, the cache or Qt.
"""
