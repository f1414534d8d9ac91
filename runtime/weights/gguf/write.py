"""Write a random-weight GGUF of a real model's shape (the Llama-like families: llama,
qwen2, qwen3, gemma3, phi3, granite, olmo2, smollm3), quantized with the block types of
:mod:`runtime.weights.quant_types`. Must not import Qt or transformers.

What for: the benchmark's 1B-scale figures without a download (``scripts/make_gguf.py``
writes Llama 3.2 1B's shape in Q4_K or Q4_0 with the default model's tokenizer), the
tests' tiny files (every block type, a few kilobytes), and the families' real shapes
(:data:`REAL_SHAPES`) written with zero weights as sparse files (``zeros=True``: the
tensor table and metadata of an 8B model in a few kilobytes of disk). Tensors are named,
shaped and ordered as llama.cpp's converter writes them (``blk.N.attn_q.weight`` ...;
Qwen2's q/k/v biases, Qwen3's q/k norms, Phi-3's fused ``attn_qkv`` and gate/up in
``ffn_up``); weights are ``N(0, std)`` from a seeded generator, one tensor at a time,
streamed to the file (a 1B-shape file needs about one tensor of memory, not the model's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from runtime.weights.gguf.config import llama3_divisors
from runtime.weights.quant_make import RANDOM_BLOCKS, quantize, random_weight_blocks
from runtime.weights.quant_types import BLOCK_TYPES, block_type


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-family decoder's sizes (``vocab`` None: the tokenizer's token count)."""

    n_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int | None = None
    context: int = 8192
    rope_base: float = 500000.0
    eps: float = 1e-5
    #: False: an ``output.weight`` of its own (the LM head not tied to the embedding).
    tied: bool = True
    #: rotated channels of a head (``rope.dimension_count``; None: all of ``head_dim``).
    rope_dim: int | None = None
    #: Gemma 3's sliding window (tokens).
    window: int = 512
    #: Llama 3's RoPE scaling factor (0: none), written as llama.cpp's converter writes it: the
    #: divisors per frequency in ``rope_freqs.weight``.
    llama3_factor: float = 0.0
    #: LongRoPE's original context (0: none): Phi-3.5's and Phi-4-mini's, written as llama.cpp's
    #: converter writes it (``rope_factors_long/short.weight``, the original context, the
    #: attention factor its converter derives); ``context`` is then the extended one.
    longrope_original: int = 0
    #: ``{arch}.rope.scaling.factor`` of a linear scaling (0: none; Gemma 3 4B's 8).
    linear_rope: float = 0.0
    #: Granite's (embedding, attention, residual, logits) multipliers, written as its converter
    #: writes them (``granite.embedding_scale``, ``.attention.scale``, ``.residual_scale``,
    #: ``.logit_scale``); empty: none.
    multipliers: tuple[float, ...] = ()


SHAPES: dict[str, LlamaShape] = {
    # meta-llama/Llama-3.2-1B's config (context kept at 8k: the bench's caches stay small;
    # its own vocabulary is 128,256 tokens: with the default model's tokenizer, 49,152).
    "llama-3.2-1b": LlamaShape(16, 2048, 8192, 32, 8, 64),
    # SmolLM2-135M's (the default model).
    "smollm2-135m": LlamaShape(30, 576, 1536, 9, 3, 64, rope_base=100000.0),
    # tests: rows of 256 (whole K-quant blocks), 2 layers
    "tiny": LlamaShape(2, 256, 512, 4, 2, 64, context=512, rope_base=10000.0),
}

#: The released models' shapes per family: ``name -> (GGUF architecture, shape, general.name)``,
#: from each model's config.json on the Hub (the context kept at 8k where it is longer, but
#: for the LongRoPE models, whose factors switch at their original 4k; the LongRoPE factors
#: themselves are made up, of the released ones' form).
REAL_SHAPES: dict[str, tuple[str, LlamaShape, str]] = {
    "llama-3.2-1b": ("llama", LlamaShape(16, 2048, 8192, 32, 8, 64, vocab=128256, llama3_factor=32.0),
                     "Llama 3.2 1B Instruct"),
    "llama-3.2-3b": ("llama", LlamaShape(28, 3072, 8192, 24, 8, 128, vocab=128256, llama3_factor=32.0),
                     "Llama 3.2 3B Instruct"),
    "qwen2.5-0.5b": ("qwen2", LlamaShape(24, 896, 4864, 14, 2, 64, vocab=151936, rope_base=1e6, eps=1e-6),
                     "Qwen2.5 0.5B Instruct"),
    "qwen2.5-1.5b": ("qwen2", LlamaShape(28, 1536, 8960, 12, 2, 128, vocab=151936, rope_base=1e6, eps=1e-6),
                     "Qwen2.5 1.5B Instruct"),
    "qwen2.5-3b": ("qwen2", LlamaShape(36, 2048, 11008, 16, 2, 128, vocab=151936, rope_base=1e6, eps=1e-6),
                   "Qwen2.5 3B Instruct"),
    "qwen2.5-7b": ("qwen2", LlamaShape(28, 3584, 18944, 28, 4, 128, vocab=152064, rope_base=1e6, eps=1e-6,
                                       tied=False), "Qwen2.5 7B Instruct"),
    "qwen3-0.6b": ("qwen3", LlamaShape(28, 1024, 3072, 16, 8, 128, vocab=151936, rope_base=1e6, eps=1e-6), "Qwen3 0.6B"),
    "qwen3-1.7b": ("qwen3", LlamaShape(28, 2048, 6144, 16, 8, 128, vocab=151936, rope_base=1e6, eps=1e-6), "Qwen3 1.7B"),
    "qwen3-4b": ("qwen3", LlamaShape(36, 2560, 9728, 32, 8, 128, vocab=151936, rope_base=1e6, eps=1e-6), "Qwen3 4B"),
    "qwen3-8b": ("qwen3", LlamaShape(36, 4096, 12288, 32, 8, 128, vocab=151936, rope_base=1e6, eps=1e-6, tied=False),
                 "Qwen3 8B"),
    "gemma-3-1b": ("gemma3", LlamaShape(26, 1152, 6912, 4, 1, 256, vocab=262144, rope_base=1e6, eps=1e-6),
                   "Gemma 3 1B It"),
    "gemma-3-4b": ("gemma3", LlamaShape(34, 2560, 10240, 8, 4, 256, vocab=262144, rope_base=1e6, eps=1e-6,
                                        window=1024, linear_rope=8.0), "Gemma 3 4B It"),
    "phi-3.5-mini": ("phi3", LlamaShape(32, 3072, 8192, 32, 32, 96, vocab=32064, context=131072, rope_base=10000.0,
                                        tied=False, longrope_original=4096), "Phi 3.5 Mini Instruct"),
    "phi-4-mini": ("phi3", LlamaShape(32, 3072, 8192, 24, 8, 128, vocab=200064, context=131072, rope_base=10000.0,
                                      rope_dim=96, longrope_original=4096), "Phi 4 Mini Instruct"),
    "smollm2-1.7b": ("llama", LlamaShape(24, 2048, 8192, 32, 32, 64, vocab=49152, rope_base=130000.0),
                     "SmolLM2 1.7B Instruct"),
    "mistral-7b": ("llama", LlamaShape(32, 4096, 14336, 32, 8, 128, vocab=32768, rope_base=1e6, tied=False),
                   "Mistral 7B Instruct v0.3"),
    "smollm3-3b": ("smollm3", LlamaShape(36, 2048, 11008, 16, 4, 128, vocab=128256, rope_base=5e6, eps=1e-6),
                   "SmolLM3 3B"),
    "granite-3.3-2b": ("granite", LlamaShape(40, 2048, 8192, 32, 8, 64, vocab=49159, rope_base=1e7,
                                             multipliers=(12.0, 0.015625, 0.22, 8.0)), "Granite 3.3 2b Instruct"),
    "granite-3.3-8b": ("granite", LlamaShape(40, 4096, 12800, 32, 8, 128, vocab=49159, rope_base=1e7,
                                             multipliers=(12.0, 0.0078125, 0.22, 16.0)), "Granite 3.3 8b Instruct"),
    "olmo-2-1b": ("olmo2", LlamaShape(16, 2048, 8192, 16, 16, 128, vocab=100352, context=4096, eps=1e-6, tied=False),
                  "OLMo 2 0425 1B Instruct"),
    "olmo-2-7b": ("olmo2", LlamaShape(32, 4096, 11008, 32, 32, 128, vocab=100352, context=4096, eps=1e-6, tied=False),
                  "OLMo 2 1124 7B Instruct"),
}

#: llama.cpp's ``general.file_type`` per all-matrices type (``gguf.LlamaFileType``).
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 12,
              "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23, "IQ1_S": 24,
              "IQ4_NL": 25, "IQ3_S": 26, "IQ2_S": 28, "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "TQ1_0": 36,
              "TQ2_0": 37, "NVFP4": 39, "Q1_0": 40}
#: Tokenizer keys copied by :func:`tokenizer_metadata` (strings and integers; arrays whole).
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")


def tokenizer_metadata(gguf_path: str | Path) -> dict[str, object]:
    """Every ``tokenizer.*`` key of a GGUF file (the vocabulary read whole)."""
    from runtime.weights.gguf.mmap import read_gguf_tensors

    meta = read_gguf_tensors(gguf_path, arrays=TOKENIZER_ARRAYS).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.") and not isinstance(v, tuple)}


def _add_value(writer, key: str, value) -> None:
    from gguf import GGUFValueType

    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, (int, np.integer)):
        writer.add_uint32(key, int(value))
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, np.ndarray):
        kind = {np.dtype("<i4"): GGUFValueType.INT32, np.dtype("<f4"): GGUFValueType.FLOAT32}[value.dtype]
        writer.add_key_value(key, [x.item() for x in value], GGUFValueType.ARRAY, sub_type=kind)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"{key}: cannot write a {type(value).__name__}")


def tensor_plan(shape: LlamaShape, vocab: int, matrix_type: str, embed_type: str,
                overrides: dict[str, str] | None = None, arch: str = "llama") -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, (rows, cols) or (n,), block type)`` of every tensor, in llama.cpp's order
    (``arch="gemma3"`` adds Gemma 3's q/k norms and the norms after attention and the MLP,
    ``"qwen3"`` q/k norms, ``"qwen2"`` q/k/v biases, ``"olmo2"`` norms after attention and the MLP
    only and q/k norms over the whole projection; ``"phi3"`` fuses q/k/v into ``attn_qkv``
    and gate/up into ``ffn_up``; an untied shape ends with ``output.weight`` in ``embed_type``).

    ``overrides`` maps a name's suffix (``"ffn_down.weight"``, ``"attn_v.weight"``) or a full
    name to a block type (as llama.cpp's Q4_K_M gives some matrices Q6_K).
    """
    H, D = shape.hidden, shape.head_dim
    plan: list[tuple[str, tuple[int, ...], str]] = []
    if shape.llama3_factor:
        plan.append(("rope_freqs.weight", ((shape.rope_dim or D) // 2,), "F32"))
    if shape.longrope_original:
        plan += [("rope_factors_long.weight", ((shape.rope_dim or D) // 2,), "F32"),
                 ("rope_factors_short.weight", ((shape.rope_dim or D) // 2,), "F32")]
    plan.append(("token_embd.weight", (vocab, H), embed_type))
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        q, kv = shape.heads * D, shape.kv_heads * D
        if arch != "olmo2":  # OLMo 2: no norm before attention or the MLP
            plan.append((p + "attn_norm.weight", (H,), "F32"))
        if arch == "phi3":
            plan.append((p + "attn_qkv.weight", (q + 2 * kv, H), matrix_type))
        else:
            plan += [(p + "attn_q.weight", (q, H), matrix_type), (p + "attn_k.weight", (kv, H), matrix_type),
                     (p + "attn_v.weight", (kv, H), matrix_type)]
        if arch == "qwen2":
            plan += [(p + "attn_q.bias", (q,), "F32"), (p + "attn_k.bias", (kv,), "F32"), (p + "attn_v.bias", (kv,), "F32")]
        plan.append((p + "attn_output.weight", (H, q), matrix_type))
        if arch != "olmo2":
            plan.append((p + "ffn_norm.weight", (H,), "F32"))
        if arch == "phi3":
            plan.append((p + "ffn_up.weight", (2 * shape.ffn, H), matrix_type))
        else:
            plan += [(p + "ffn_gate.weight", (shape.ffn, H), matrix_type), (p + "ffn_up.weight", (shape.ffn, H), matrix_type)]
        plan.append((p + "ffn_down.weight", (H, shape.ffn), matrix_type))
        if arch in ("gemma3", "qwen3"):
            plan += [(p + "attn_q_norm.weight", (D,), "F32"), (p + "attn_k_norm.weight", (D,), "F32")]
        if arch == "olmo2":  # over each token's whole query and key
            plan += [(p + "attn_q_norm.weight", (q,), "F32"), (p + "attn_k_norm.weight", (kv,), "F32")]
        if arch in ("gemma3", "olmo2"):
            plan += [(p + "post_attention_norm.weight", (H,), "F32"), (p + "post_ffw_norm.weight", (H,), "F32")]
    plan.append(("output_norm.weight", (H,), "F32"))
    if not shape.tied:
        plan.append(("output.weight", (vocab, H), embed_type))
    if overrides:
        out = []
        for name, dims, t in plan:
            key = next((k for k in overrides if name == k or name.endswith("." + k) or name.endswith(k)), None)
            out.append((name, dims, overrides[key] if key and len(dims) == 2 else t))
        plan = out
    return plan


def _holes(w, path: Path, sizes: list[int], first: list[np.ndarray]) -> Path:
    """End the file ``w`` is writing (header and tensor table written) with its tensors'
    bytes as one hole: the size the data would take, aligned as the writer aligns it
    (``first``: the first tensors' bytes, written: the RoPE tensors)."""
    fout = w.fout[0]
    start = w.ggml_pad(fout.tell(), w.data_alignment)
    fout.truncate(start + sum(w.ggml_pad(n, w.data_alignment) for n in sizes))
    offset = start
    for data in first:
        fout.seek(offset)
        fout.write(data.tobytes())
        offset += w.ggml_pad(data.nbytes, w.data_alignment)
    w.close()
    return path


def write_random_gguf(
    path: str | Path,
    shape: LlamaShape | str,
    *,
    matrix_type: str = "Q4_K",
    embed_type: str | None = None,
    overrides: dict[str, str] | None = None,
    tokenizer: dict[str, object] | None = None,
    name: str | None = None,
    seed: int = 0,
    std: float = 0.02,
    arch: str = "llama",
    window: int | None = None,
    zeros: bool = False,
) -> Path:
    """Write a random-weight Llama-family GGUF to ``path`` and return it.

    Args:
        shape: a :class:`LlamaShape` or a key of :data:`SHAPES`.
        matrix_type: every projection's block type (a key of
            :data:`runtime.weights.quant_types.BLOCK_TYPES`).
        embed_type: the (tied) token embedding's type; default Q6_K for K-quant
            matrices, Q8_0 otherwise (what llama.cpp's quantizer gives the tied output).
        overrides: per-tensor types (see :func:`tensor_plan`).
        tokenizer: ``tokenizer.*`` metadata (:func:`tokenizer_metadata`); its token list
            sets the vocabulary unless ``shape.vocab`` does. Without it: no tokenizer keys,
            and ``shape.vocab`` must be set.
        std: the weights' standard deviation (norm weights are ``1 + N(0, std)``).
        arch: ``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"phi3"``, ``"granite"`` (its multipliers from
            ``shape.multipliers``), ``"olmo2"``, ``"smollm3"`` or ``"gemma3"`` (Gemma 3's
            extra norms, its sliding window and llama.cpp's stored ``1 + w`` norm weights):
            the metadata keys are ``{arch}.*``, the tensors :func:`tensor_plan`'s.
        window: Gemma 3's sliding window in tokens (default ``shape.window``).
        zeros: every tensor all zero bytes, left as a hole of a sparse file (nothing
            written: for the header, the tensor table and the loader's shape checks of a
            real-size model; zero blocks decode to zeros in every type).

    Raises:
        KeyError: an unknown block type. ValueError: no vocabulary size.
    """
    from gguf import GGMLQuantizationType, GGUFWriter

    if isinstance(shape, str):
        shape = SHAPES[shape]
    tokens = (tokenizer or {}).get("tokenizer.ggml.tokens")
    vocab = shape.vocab or (len(tokens) if tokens else None)
    if vocab is None:
        raise ValueError("no vocabulary size: give a tokenizer or a shape with vocab")
    shape = replace(shape, vocab=vocab)
    block_type(matrix_type)
    if embed_type is None:
        embed_type = "Q6_K" if matrix_type.endswith("_K") else "Q8_0"
    plan = tensor_plan(shape, vocab, matrix_type, embed_type, overrides, arch)
    path = Path(path)
    w = GGUFWriter(str(path), arch)
    w.add_name(name or f"random {matrix_type} {shape.n_layers}x{shape.hidden}")
    w.add_block_count(shape.n_layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.eps)
    if shape.rope_dim is None:
        w.add_rope_dimension_count(shape.head_dim)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_vocab_size(vocab)
    if arch == "gemma3":
        w.add_sliding_window(shape.window if window is None else window)
    if shape.rope_dim is not None:
        w.add_rope_dimension_count(shape.rope_dim)
    if shape.linear_rope:
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(shape.linear_rope)
    if shape.multipliers:
        embedding, attention, residual, logits = shape.multipliers
        w.add_embedding_scale(embedding)
        w.add_attention_scale(attention)
        w.add_residual_scale(residual)
        w.add_logit_scale(logits)
    if shape.longrope_original:
        w.add_rope_scaling_orig_ctx_len(shape.longrope_original)
        scale = shape.context / shape.longrope_original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(shape.longrope_original))
                                        if scale > 1 else 1.0)
    w.add_file_type(FILE_TYPES.get(matrix_type, 1024))
    w.add_quantization_version(2)
    for key, value in (tokenizer or {}).items():
        _add_value(w, key, value)
    sizes = []
    for tname, dims, t in plan:
        bt = BLOCK_TYPES[t]
        rows = dims[0] if len(dims) == 2 else 1
        cols = dims[-1]
        nbytes = rows * bt.row_bytes(cols)
        sizes.append(nbytes)
        if bt.quantized or t == "BF16":
            w.add_tensor_info(tname, (rows, bt.row_bytes(cols)) if len(dims) == 2 else (bt.row_bytes(cols),),
                              np.dtype(np.uint8), nbytes, raw_dtype=GGMLQuantizationType(bt.ggml_type))
        else:
            w.add_tensor_info(tname, dims, np.dtype(np.float32 if t == "F32" else np.float16), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    divisors = np.array(llama3_divisors(shape.rope_base, shape.rope_dim or shape.head_dim, shape.llama3_factor),
                        dtype=np.float32) if shape.llama3_factor else None
    half = (shape.rope_dim or shape.head_dim) // 2
    # LongRoPE's factors: rising from 1 over the frequencies, the long ones further (the released ones' form)
    longrope = {"rope_factors_long.weight": np.linspace(1.0, 40.0, half, dtype=np.float32),
                "rope_factors_short.weight": np.linspace(1.0, 2.0, half, dtype=np.float32)} if shape.longrope_original else {}
    if zeros:
        first = [divisors] if divisors is not None else list(longrope.values())
        return _holes(w, path, sizes, first)
    rng = np.random.default_rng(seed)
    for tname, dims, t in plan:
        bt = BLOCK_TYPES[t]
        if tname == "rope_freqs.weight":
            w.write_tensor_data(divisors)
            continue
        if tname in longrope:
            w.write_tensor_data(longrope[tname])
            continue
        if len(dims) == 1:  # norms near 1 (Gemma stores 1 + w: near 2), not all equal; biases near 0
            centre = 0.0 if tname.endswith(".bias") else 1.0 + (arch == "gemma3")
            data = (centre + rng.standard_normal(dims, dtype=np.float32) * np.float32(std)).astype(np.float32)
            w.write_tensor_data(data if t == "F32" else quantize(data.reshape(1, -1), bt).reshape(-1).view(
                np.float16 if t == "F16" else np.uint8))
            continue
        rows, cols = dims
        if t in RANDOM_BLOCKS:  # random bits of the type's layout (see quant_make.RANDOM_BLOCKS)
            w.write_tensor_data(random_weight_blocks(bt, rows, cols, std, seed=int(rng.integers(1 << 31))))
            continue
        out = np.empty((rows, bt.row_bytes(cols)), dtype=np.uint8)
        step = max(1, (1 << 22) // cols)  # 16 MiB of float32 at a time
        for r0 in range(0, rows, step):
            chunk = rng.standard_normal((min(step, rows - r0), cols), dtype=np.float32) * np.float32(std)
            out[r0 : r0 + chunk.shape[0]] = quantize(chunk, bt)
        if t == "F32":
            w.write_tensor_data(out.view(np.float32))
        elif t == "F16":
            w.write_tensor_data(out.view(np.float16))
        else:
            w.write_tensor_data(out)
    w.close()
    return path
