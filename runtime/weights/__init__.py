"""Reading a model's files: GGUF and transformers folders (safetensors only), their checks
and refusals (pickles, custom code, oversized metadata), and the decoder's state dict.

May import torch, transformers, gguf, safetensors, :mod:`runtime.config` and the base
modules (errors, dtypes, device, quantize); never the decoder, the cache or Qt.
Never ``trust_remote_code``; never unpickle.
"""
