"""Requantize a GGUF's matrices to another block type with ggml's own quantizers.

    .venv/bin/python scripts/requantize_gguf.py OUT.gguf --type IQ4_XS [--source FILE.gguf]

Default source: the default model (SmolLM2-135M-Instruct Q4_1). Every matrix but the token
embedding (the tied LM head: kept in the file's own type, as it is) is dequantized to
float32 (ggml's ``to_float``) and quantized to ``--type`` by ggml's ``ggml_quantize_chunk``
(no importance matrix: the types that need one are refused). A matrix whose rows are not
whole blocks of the type gets llama.cpp's fallback for it (``llama-quant.cpp``: the
256-weight types fall back to IQ4_NL, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0), as
llama-quantize would: the default model's rows of 576 are not whole 256-blocks, so its
"Q2_K" file holds Q2_K only in ``ffn_down`` (rows of 1,536) and IQ4_NL elsewhere. Metadata
and the tokenizer are copied; ``general.file_type`` is set to the type's.

For the quality table (scripts/quant_quality.py) and ``attnchat bench --model OUT.gguf``:
files made from a real model's weights, not for publishing.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

#: llama.cpp's fallback for rows that are not whole blocks (llama-quant.cpp, ``tensor_type_fallback``).
FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL",
            "IQ2_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "TQ1_0": "IQ4_NL", "TQ2_0": "IQ4_NL",
            "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def requantize(source: Path, out: Path, type_name: str) -> Counter:
    """Write ``out``: ``source`` with its matrices in ``type_name`` (see the module docstring).
    Returns the count of matrices per block type written."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    from runtime.kernels import ggml_ops
    from runtime.weights.gguf.write import FILE_TYPES
    from runtime.weights.quant_make import ggml_quantize
    from runtime.weights.quant_types import BLOCK_TYPES, BY_ID

    import ggml

    target = BLOCK_TYPES[type_name]
    if ggml.ggml_quantize_requires_imatrix(target.ggml_type):
        raise SystemExit(f"{type_name} needs an importance matrix; this script quantizes without one")
    if not ggml_ops.available():
        raise SystemExit(f"ggml-python does not load: {ggml_ops.unavailable_reason()}")
    reader = GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    writer.add_file_type(FILE_TYPES.get(type_name, 1024))
    counts: Counter = Counter()
    for t in reader.tensors:
        src = BY_ID[int(t.tensor_type)]
        shape = tuple(int(d) for d in reversed(t.shape))  # torch order, rows last
        if len(shape) == 2 and t.name != "token_embd.weight" and src.quantized:
            rows, cols = shape
            kind = target if cols % target.block_size == 0 else BLOCK_TYPES[FALLBACK.get(type_name, "Q8_0")]
            raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(rows, -1))
            w = ggml_ops.to_float(raw, src.ggml_type, torch.empty(rows, cols)).numpy()
            data = ggml_quantize(w, kind)
        else:
            kind, data = src, np.ascontiguousarray(t.data)
        counts[kind.name] += 1
        if kind.quantized or kind.name == "BF16":
            writer.add_tensor(t.name, data.view(np.uint8), raw_shape=data.shape if data.ndim == 2 else None,
                              raw_dtype=GGMLQuantizationType(kind.ggml_type))
        else:
            writer.add_tensor(t.name, data.reshape(shape) if len(shape) > 1 else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", required=True)
    ap.add_argument("--source", type=Path, help="the GGUF whose weights are requantized (default: the default model)")
    args = ap.parse_args(argv)
    src = args.source
    if src is None:
        from models import fetch

        src = fetch.ensure_default()
    t0 = time.perf_counter()
    counts = requantize(Path(src), args.out, args.type.upper())
    mix = ", ".join(f"{n} x{c}" for n, c in counts.most_common())
    print(f"{args.out}: {args.out.stat().st_size / 1e6:.1f} MB from {Path(src).name} ({mix}; "
          f"{time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
