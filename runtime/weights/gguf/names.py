"""The decoder's weights from a GGUF's own blocks: GGUF tensor names -> decoder names, no
dequantization. Must not import Qt or transformers.

What the decoder gets (:class:`GGUFWeights`): every matrix as a list of
:class:`runtime.kernels.quantized.QuantWeight` parts stacked along the output rows (q, k,
v of a layer; gate and up), the token embedding as one (looked up a row at a time,
and the LM head when tied), and the small float tensors (norms, biases) in float32.

Parts that share a block type are fused into one buffer (one product instead of three
per layer: on the default model 120 calls a token fewer), read with ``pread`` into fresh
memory rather than through the file's map, so the file's pages for them are never
touched and counted twice. Everything else is a view of the map: memory about the
file's size, as llama.cpp's. The two conversions llama.cpp's converter applies and
transformers undoes are undone here the same way: llama's q/k rows are permuted back
(``LlamaTensorProcessor._reverse_permute_weights``; Granite's and SmolLM3's too, whose converters
are llama's), a row permutation exact on blocks;
Gemma's norm weights are stored ``w + 1`` (``Gemma2TensorProcessor``).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.weights.block_source import BlockSource, ModelFile, Segment
from runtime.weights.gguf.mmap import GGUFTensors
from runtime.weights.quant_types import block_type
from runtime.weights.quant_weight import QuantWeight

#: GGUF architectures whose matrices this module maps (llama.cpp's names for them).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "granite", "olmo2", "smollm3")
#: Those whose q/k rows llama.cpp's converter permutes (its ``LlamaModel`` and the classes built on it).
PERMUTED = ("llama", "granite", "smollm3")


class MissingTensorError(KeyError):
    """The file lacks a tensor its architecture needs (the message names it)."""


@dataclass
class GGUFWeights:
    """A GGUF's weights in the decoder's names.

    Attributes:
        matrices: ``"blocks.0.attn.qkv_proj"`` -> parts (stacked along the output rows).
        embed: the token embedding ``(vocab, hidden)``.
        head: the LM head's parts when not tied to the embedding, else None.
        floats: norm weights and biases, float32, named as in the decoder's state dict.
        file_type: llama.cpp's name for the file's mix (``"Q4_K_M"``), or the main block type.
        types: block type name -> matrices of it (counts).
    """

    matrices: dict[str, list[QuantWeight]]
    embed: QuantWeight
    head: list[QuantWeight] | None
    floats: dict[str, torch.Tensor]
    file_type: str
    types: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of every block in memory, of the kernels' forms and of the float tensors (the blocks
        a repacked form replaced are not in memory: :meth:`QuantWeight.drop_blocks`)."""
        seen, total = set(), 0
        for w in self._all():
            if id(w) not in seen:
                seen.add(id(w))
                total += w.resident_bytes + w.extra_bytes
        return total + sum(t.numel() * t.element_size() for t in self.floats.values())

    def _all(self) -> list[QuantWeight]:
        out = [w for parts in self.matrices.values() for w in parts] + [self.embed]
        return out + (self.head or [])


@functools.cache
def file_type_names() -> dict[int, str]:
    """``general.file_type`` -> llama.cpp's name of the mix (``gguf.LlamaFileType``, MOSTLY_ dropped)."""
    from gguf import LlamaFileType

    return {int(v): v.name.removeprefix("MOSTLY_").removeprefix("ALL_") for v in LlamaFileType if v.name != "GUESSED"}


def file_type_name(g: GGUFTensors) -> str:
    """llama.cpp's name for the file's quantization (``general.file_type``), else its most common matrix type."""
    ft = g.metadata.get("general.file_type")
    if isinstance(ft, int) and ft in file_type_names():
        return file_type_names()[ft]
    counts: dict[str, int] = {}
    for info in g.tensors.values():
        if len(info.shape) == 2:
            try:
                name = block_type(info.ggml_type).name
            except KeyError:
                continue
            counts[name] = counts.get(name, 0) + 1
    return max(counts, key=counts.get) if counts else "unknown"


def _weight(g: GGUFTensors, name: str, file: ModelFile | None = None) -> QuantWeight:
    info = _info(g, name)
    rows, cols = info.shape if len(info.shape) == 2 else (1, info.shape[0])
    source = None if file is None else BlockSource(file, info.nbytes // rows, (Segment(info.offset, rows),))
    return QuantWeight(g.raw(name), block_type(info.ggml_type), rows, cols, source)


def _info(g: GGUFTensors, name: str):
    try:
        return g.tensors[name]
    except KeyError:
        raise MissingTensorError(f"the file has no tensor {name!r}; it is incomplete or not the architecture "
                                 "its metadata says: download it again") from None


def _float(g: GGUFTensors, name: str, minus_one: bool = False) -> torch.Tensor:
    from runtime.weights.quant_types import dequantize

    info = _info(g, name)
    t = dequantize(g.raw(name), block_type(info.ggml_type), info.shape).to(torch.float32)
    return t - 1 if minus_one else t.clone()


def _llama_unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation: new row ``n`` is old row ``perm[n]``
    (transformers' ``_reverse_permute_weights``: ``(heads, dim, 2)`` -> ``(heads, 2, dim)``)."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(-1)


def _fused(g: GGUFTensors, names: list[str], perms: list[torch.Tensor | None],
           file: ModelFile | None = None) -> list[QuantWeight]:
    """``names`` as parts; runs of one block type (and row length) read into one buffer with
    ``pread`` (each part's rows reordered by its ``perm``), others as views of the map. With
    ``file``, each part says where its rows lie in it (:class:`BlockSource`)."""
    infos = [_info(g, n) for n in names]
    out: list[QuantWeight] = []
    i = 0
    while i < len(names):
        j = i + 1
        while j < len(names) and infos[j].ggml_type == infos[i].ggml_type and infos[j].shape[1:] == infos[i].shape[1:]:
            j += 1
        if j - i == 1 and perms[i] is None:
            out.append(_weight(g, names[i], file))
        else:
            rows = sum(infos[k].shape[0] for k in range(i, j))
            row_bytes = infos[i].nbytes // infos[i].shape[0]
            buf = torch.empty(rows, row_bytes, dtype=torch.uint8)
            r0 = 0
            with open(g.path, "rb", buffering=0) as f:
                for k in range(i, j):
                    n = infos[k].shape[0]
                    part = buf[r0 : r0 + n]
                    got = os.preadv(f.fileno(), [memoryview(part.numpy()).cast("B")], infos[k].offset)
                    if got != infos[k].nbytes:
                        raise OSError(f"short read of {names[k]!r} ({got} of {infos[k].nbytes} bytes)")
                    if perms[k] is not None:  # numpy: torch's index_select of uint8 rows took 12 ms a matrix, this 8 us
                        rows_np = part.numpy()
                        rows_np[:] = np.take(rows_np, perms[k].numpy(), axis=0)
                    r0 += n
            source = None if file is None else BlockSource(
                file, row_bytes, tuple(Segment(infos[k].offset, infos[k].shape[0], perms[k]) for k in range(i, j)))
            out.append(QuantWeight(buf, block_type(infos[i].ggml_type), rows, infos[i].shape[1], source))
        i = j
    return out


def gguf_weights(g: GGUFTensors, n_layers: int, n_heads: int, n_kv_heads: int, *, fuse: bool = True) -> GGUFWeights:
    """The decoder's weights of the GGUF ``g`` (architecture from its metadata).

    Args:
        n_layers, n_heads, n_kv_heads: from the model's config (the permutation needs the heads).
        fuse: read same-type q/k/v and gate/up into one buffer each (False: views only,
            one product per GGUF tensor; llama's q/k still need a reordered copy).

    Raises:
        MissingTensorError: a tensor the architecture needs is absent.
        KeyError: a block type attnchat does not run; ValueError: an architecture it does not map.
    """
    arch = str(g.metadata.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not mapped to the decoder's quantized layers")
    gemma = arch in ("gemma2", "gemma3")
    floats: dict[str, torch.Tensor] = {}
    matrices: dict[str, list[QuantWeight]] = {}

    file = ModelFile(g.path)   # where a dropped weight's blocks are read again (runtime.weights.block_source)

    def group(names, perms):
        if fuse:
            return _fused(g, names, perms, file)
        return [p for n, perm in zip(names, perms) for p in _fused(g, [n], [perm], file)]

    for i in range(n_layers):
        p, b = f"blk.{i}.", f"blocks.{i}."
        if arch == "olmo2":  # no norm before attention or the MLP: one after each
            floats[b + "post_attn_norm.weight"] = _float(g, p + "post_attention_norm.weight")
            floats[b + "post_mlp_norm.weight"] = _float(g, p + "post_ffw_norm.weight")
        elif gemma:
            floats[b + "attn_norm.weight"] = _float(g, p + "attn_norm.weight", gemma)
            floats[b + "post_attn_norm.weight"] = _float(g, p + "post_attention_norm.weight", True)
            floats[b + "mlp_norm.weight"] = _float(g, p + "ffn_norm.weight", True)
            floats[b + "post_mlp_norm.weight"] = _float(g, p + "post_ffw_norm.weight", True)
        else:
            floats[b + "attn_norm.weight"] = _float(g, p + "attn_norm.weight")
            floats[b + "mlp_norm.weight"] = _float(g, p + "ffn_norm.weight")
        if p + "attn_q_norm.weight" in g.tensors:
            floats[b + "attn.q_norm.weight"] = _float(g, p + "attn_q_norm.weight", gemma)
            floats[b + "attn.k_norm.weight"] = _float(g, p + "attn_k_norm.weight", gemma)
        if p + "attn_qkv.weight" in g.tensors:  # Phi-3: fused already
            matrices[b + "attn.qkv_proj"] = group([p + "attn_qkv.weight"], [None])
        else:
            perm_q = _llama_unpermute(_info(g, p + "attn_q.weight").shape[0], n_heads) if arch in PERMUTED else None
            perm_k = _llama_unpermute(_info(g, p + "attn_k.weight").shape[0], n_kv_heads) if arch in PERMUTED else None
            matrices[b + "attn.qkv_proj"] = group([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                                                  [perm_q, perm_k, None])
            if p + "attn_q.bias" in g.tensors:  # Qwen2
                floats[b + "attn.qkv_proj.bias"] = torch.cat([_float(g, p + f"attn_{n}.bias") for n in "qkv"])
        matrices[b + "attn.o_proj"] = group([p + "attn_output.weight"], [None])
        if p + "ffn_gate.weight" in g.tensors:
            matrices[b + "mlp.gate_up_proj"] = group([p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None])
        else:  # Phi-3: gate and up fused in ffn_up
            matrices[b + "mlp.gate_up_proj"] = group([p + "ffn_up.weight"], [None])
        matrices[b + "mlp.down_proj"] = group([p + "ffn_down.weight"], [None])
    floats["final_norm.weight"] = _float(g, "output_norm.weight", gemma)
    embed = _weight(g, "token_embd.weight", file)
    head = [_weight(g, "output.weight", file)] if "output.weight" in g.tensors else None
    types: dict[str, int] = {}
    for w in [w for parts in matrices.values() for w in parts] + [embed] + (head or []):
        types[w.btype.name] = types.get(w.btype.name, 0) + 1
    return GGUFWeights(matrices, embed, head, floats, file_type_name(g), types)
