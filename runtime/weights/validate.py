"""One check of a GGUF's tensors before anything is built from them: its shape numbers, every
tensor's type, size and shape against the config, and every block's scales finite. Every
GGUF load (:func:`runtime.loader.load.load_model`: chat, serve, the desktop) and every
config read (:func:`runtime.loader.load.read_config`: ``attnchat memory``, the planner's fit)
calls :func:`check_gguf`; a Hub file's header gets the same shape rule
(:mod:`models.safety.shape`). Must not import Qt or transformers.

What it refuses, each in one line naming the tensor (:class:`runtime.errors.ModelLoadError`):

1. shape numbers below 1 or past any model's (:func:`models.safety.check_shape`): a
   ``head_count`` of 0 divided by zero in the config, a ``block_count`` of 1,000,000;
2. a tensor with a 0 dimension, a row length that is not whole blocks of its type, a byte
   size that is not its shape's, or bytes that overlap another tensor's or pass the file's end;
3. a tensor the decoder reads whose shape is not the one the config gives (a 1,000-row
   embedding for 49,152 tokens indexed past its end; a 256 x 256 ``ffn_down`` where
   256 x 512 is due failed inside oneDNN), or a layer's tensors missing;
4. a NaN or an infinity in a block's scales (float16 ``d``/``dmin``/``m`` of the quantized
   types, at the offsets of ggml-common.h's block structs) or in a float tensor: such a
   file answered ``""`` with finish_reason "stop", and one relabelled as another type of the
   same block length (IQ4_XS over Q4_K) reads its codes as scales.

The scan reads the file once with ``pread`` in chunks of whole blocks (no memory map: a file
cut short under it gives a short read, not a SIGBUS), keeping one chunk (16 MiB) at a time;
of each block it looks at the two or four bytes of its scales.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from models import safety
from runtime.config.model import ModelConfig
from runtime.errors import ModelLoadError

__all__ = ["SCALES", "check_gguf", "expected_shapes"]

#: Type name -> (bytes per block, byte offsets of its float16 scales, or "f32"/"f16"/"bf16"
#: for a float type, whose values are checked whole). ggml-common.h's block structs; the
#: block sizes are gguf's (``GGML_QUANT_SIZES``; a test checks they agree). Types without a
#: float scale (IQ1_M's packed scale, the integer types, MXFP4's exponent byte) are not scanned.
SCALES: dict[str, tuple[int, tuple[int, ...] | str]] = {
    "F32": (4, "f32"), "F16": (2, "f16"), "BF16": (2, "bf16"),
    "Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)), "Q5_1": (24, (0, 2)), "Q8_0": (34, (0,)),
    "Q8_1": (40, (0, 2)), "Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)), "IQ2_XXS": (66, (0,)), "IQ2_XS": (74, (0,)),
    "IQ3_XXS": (98, (0,)), "IQ1_S": (50, (0,)), "IQ4_NL": (18, (0,)), "IQ3_S": (110, (0,)), "IQ2_S": (82, (0,)),
    "IQ4_XS": (136, (0,)), "TQ1_0": (54, (52,)), "TQ2_0": (66, (64,)),
}
#: Exponent bits all ones (an infinity or a NaN) per float width.
_EXPONENT = {"f16": (np.uint16, 0x7C00), "bf16": (np.uint16, 0x7F80), "f32": (np.uint32, 0x7F800000)}
CHUNK_BYTES = 16 << 20
_FIX = "the file is damaged or not the model its metadata says: download it again"


def check_gguf(path: Path, g=None, cfg: ModelConfig | None = None) -> None:
    """Refuse the GGUF at ``path`` as the module says. ``g``: its tensor table
    (:func:`runtime.weights.gguf.open.open_gguf`, read here when None); ``cfg``: its config
    (built from ``g`` when None; where the config cannot be built, the shapes are left to
    the loader, whose message names the architecture).

    Raises:
        ModelLoadError: one line naming the key or the tensor, what it is and what is due.
    """
    from runtime.weights.gguf import open as gguf_open

    path = Path(path)
    g = g if g is not None else gguf_open.open_gguf(path)
    try:
        safety.check_shape(g.metadata, path.name)
    except safety.Refused as e:
        raise ModelLoadError(str(e)) from None
    if cfg is None:
        cfg = _config(g)
    _check_table(path, g)
    if cfg is not None:
        _check_shapes(path, g, cfg)
    from runtime.weights import checked

    if not checked.passed(path):  # the scan's verdict on this very file, unchanged since
        _scan(path, g)
        checked.remember(path)


def _config(g) -> ModelConfig | None:
    from runtime.weights.gguf import config as gguf_config

    try:
        return ModelConfig.from_hf(gguf_config.hf_config(g))
    except Exception:  # noqa: BLE001 - an architecture we do not run: the loader says so itself
        return None


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _check_table(path: Path, g) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    spans = []
    for t in g.tensors.values():
        kind = _type_name(t.ggml_type)
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path.name}: tensor {t.name!r} has {kind}, which attnchat cannot read; {_FIX}") from None
        if not t.shape or min(t.shape) < 1:
            raise ModelLoadError(f"{path.name}: tensor {t.name!r} has shape {_dims(t.shape)}, with no elements; {_FIX}")
        cols, rows = t.shape[-1], int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
        if cols % block:
            raise ModelLoadError(f"{path.name}: tensor {t.name!r} ({kind}) has rows of {cols:,} values, not whole "
                                 f"blocks of {block}; {_FIX}")
        if rows * (cols // block) * block_bytes != t.nbytes:
            raise ModelLoadError(f"{path.name}: tensor {t.name!r} ({kind}, {_dims(t.shape)}) says {t.nbytes:,} bytes "
                                 f"where its shape takes {rows * (cols // block) * block_bytes:,}; {_FIX}")
        if t.offset < 0 or t.offset + t.nbytes > size:
            raise ModelLoadError(f"{path.name}: tensor {t.name!r} passes the file's end; the file is truncated or "
                                 "damaged: download it again")
        spans.append((t.offset, t.offset + t.nbytes, t.name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ModelLoadError(f"{path.name}: tensors {a!r} and {b!r} share bytes (a tensor's type or shape was "
                                 f"changed); {_FIX}")


def _dims(shape) -> str:
    return " x ".join(f"{d:,}" for d in shape)


def expected_shapes(cfg: ModelConfig, names) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """(shape due, torch order, for each of ``names`` (a file's tensors) the decoder reads,
    the tensors a layer cannot do without that ``names`` lacks). Names this module does not
    know (``rope_freqs.weight``...) are not in the result."""
    V, H, F = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    Q, KV = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    names = set(names)
    top = {"token_embd.weight": (V, H), "output.weight": (V, H), "output_norm.weight": (H,), "output_norm.bias": (H,),
           "position_embd.weight": (cfg.max_position_embeddings, H)}
    due = {n: s for n, s in top.items() if n in names}
    missing = [] if "token_embd.weight" in names else ["token_embd.weight"]
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        fused_up = p + "ffn_gate.weight" not in names and cfg.family == "llama"  # Phi-3: gate and up in ffn_up
        layer = {"attn_norm.weight": (H,), "attn_norm.bias": (H,), "ffn_norm.weight": (H,), "ffn_norm.bias": (H,),
                 "attn_q.weight": (Q, H), "attn_k.weight": (KV, H), "attn_v.weight": (KV, H),
                 "attn_q.bias": (Q,), "attn_k.bias": (KV,), "attn_v.bias": (KV,),
                 "attn_qkv.weight": (Q + 2 * KV, H), "attn_qkv.bias": (Q + 2 * KV,),
                 "attn_output.weight": (H, Q), "attn_output.bias": (H,),
                 "ffn_gate.weight": (F, H), "ffn_up.weight": (2 * F if fused_up else F, H), "ffn_up.bias": (F,),
                 "ffn_down.weight": (H, F), "ffn_down.bias": (H,),
                 "attn_q_norm.weight": (Q if cfg.qk_norm_whole else cfg.head_dim,),
                 "attn_k_norm.weight": (KV if cfg.qk_norm_whole else cfg.head_dim,),
                 "post_attention_norm.weight": (H,), "post_ffw_norm.weight": (H,)}
        due.update({p + n: s for n, s in layer.items() if p + n in names})
        need = ["attn_norm.weight"] if cfg.pre_norms else ["post_attention_norm.weight", "post_ffw_norm.weight"]
        need += ["attn_output.weight", "ffn_up.weight", "ffn_down.weight"]
        need += ["attn_qkv.weight"] if p + "attn_qkv.weight" in names else ["attn_q.weight", "attn_k.weight", "attn_v.weight"]
        missing += [p + n for n in need if p + n not in names]
    return due, missing


def _check_shapes(path: Path, g, cfg: ModelConfig) -> None:
    due, missing = expected_shapes(cfg, g.tensors)
    if missing:
        raise ModelLoadError(f"{path.name}: the file has no tensor {missing[0]!r} (its config gives {cfg.n_layers:,} "
                             f"layers); {_FIX}")
    for name, shape in due.items():
        have = tuple(g.tensors[name].shape)
        if len(shape) == 1 and len(have) == 2 and have[0] == 1:  # a vector stored as one row
            have = have[1:]
        if have != shape:
            raise ModelLoadError(f"{path.name}: tensor {name!r} has shape {_dims(have)} where its config (vocabulary "
                                 f"{cfg.vocab_size:,}, hidden {cfg.hidden_size:,}, {cfg.n_heads} heads of "
                                 f"{cfg.head_dim}, {cfg.n_kv_heads} key/value heads, feed-forward "
                                 f"{cfg.intermediate_size:,}) gives {_dims(shape)}; {_FIX}")


def _scan(path: Path, g) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for t in sorted(g.tensors.values(), key=lambda t: t.offset):
            kind = _type_name(t.ggml_type)
            if kind not in SCALES:
                continue
            block_bytes, where = SCALES[kind]
            n_blocks = t.nbytes // block_bytes
            per = max(1, CHUNK_BYTES // block_bytes)
            bad = first = 0
            for b0 in range(0, n_blocks, per):
                n = min(per, n_blocks - b0)
                data = os.pread(fd, n * block_bytes, t.offset + b0 * block_bytes)
                if len(data) != n * block_bytes:
                    raise ModelLoadError(f"{path.name}: the file ends inside tensor {t.name!r}; it is truncated: "
                                         "download it again")
                blocks = np.frombuffer(data, dtype=np.uint8).reshape(n, block_bytes)
                if isinstance(where, str):  # a float type: a block is one value
                    word, exp = _EXPONENT[where]
                    wrong = (blocks.reshape(-1).view(word) & exp) == exp
                else:
                    cols = np.concatenate([blocks[:, a:a + 2] for a in where], axis=1)
                    wrong = ((np.ascontiguousarray(cols).view("<u2") & 0x7C00) == 0x7C00).any(axis=1)
                count = int(wrong.sum())
                if count and not bad:
                    first = b0 + int(np.argmax(wrong))
                bad += count
            if bad:
                what, unit = ("values", "values") if isinstance(where, str) else ("scales", "blocks")
                raise ModelLoadError(f"{path.name}: tensor {t.name!r} ({kind}) has NaN or infinite {what} in {bad:,} of "
                                     f"its {n_blocks:,} {unit} (the first: {unit[:-1]} {first:,}); the file is damaged, "
                                     "or a tensor was relabelled as another type: download it again")
    finally:
        os.close(fd)
