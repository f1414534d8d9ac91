"""Reading and writing GGUF files, a module for each thing it holds:

- :mod:`.mmap`: the tensor table and scalar metadata through the bounded header reader, and the
  file mapped once (a tensor is a view of its pages);
- :mod:`.names`: GGUF tensor names -> the decoder's, as quantized blocks (no dequantization);
- :mod:`.open`: a GGUF opened for the decoder from its own blocks (config, tokenizer, weights,
  a widened state dict on request);
- :mod:`.config`: transformers' config and tokenizer from our own header reader;
- :mod:`.converted`: transformers' GGUF path and what the cache folder keeps of it;
- :mod:`.write`: random-weight GGUFs of a real model's shape (tests, the benchmark).

The metadata limits and the bounded scan are :mod:`models.safety.gguf_scan`'s. Must not import Qt.
"""
