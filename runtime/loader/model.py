"""A loaded model: tokenizer, config, decoder on its device, and how it runs one token.

Must not import Qt.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from runtime.cache.kv_cache import KVCache
from runtime.config.model import ModelConfig
from runtime.dtypes import parse_cache_dtype
from runtime.kernels.choice import KernelChoice
from runtime.kernels.quant_choice import QuantChoice
from runtime.kernels.threads import SizedGovernors, ThreadGovernor
from runtime.model.decode_step import DecodeStep
from runtime.model.decoder import Decoder
from runtime.model.prefill_forms import PrefillForms


@dataclass
class Model:
    """A loaded model, ready to run.

    Attributes:
        tokenizer: the transformers tokenizer (with its chat template, if any).
        path: the file or folder it came from.
        config: our :class:`ModelConfig`.
        device: where the weights live.
        dtype: the weights' dtype; for a GGUF run from its own blocks, the file's
            quantization as llama.cpp names it (``"Q4_K_M"``), a string.
        compute_dtype: the activations' dtype; :func:`runtime.device.compute_dtype`.
        cache_dtype: the KV cache's dtype when none is asked for
            (:func:`runtime.device.default_cache_dtype`; None: ``compute_dtype``).
        decoder: our :class:`runtime.model.decoder.Decoder`.
        load_seconds: wall time of :func:`load_model` (seconds).
        decode_mode: how :meth:`decode_next` runs one token (:data:`runtime.model.decode_step.DECODE_MODES`).
    """

    tokenizer: Any
    path: Path
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype | str
    decoder: Decoder
    compute_dtype: torch.dtype = torch.float32
    cache_dtype: torch.dtype | None = None
    load_seconds: float = 0.0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    decode_mode: str = "eager"
    _step: DecodeStep | None = field(default=None, repr=False)
    #: The CPU kernels the decoder's matrix products use (None off the CPU): see
    #: :mod:`runtime.kernels`.
    kernels: KernelChoice | None = None
    #: For a GGUF run from its own blocks, the kernels per block type (decode, prefill):
    #: :mod:`runtime.kernels.quant_choice`; None otherwise.
    quant_kernels: QuantChoice | None = None
    #: On the CPU, what picks the thread count of each decode step and of each prefill
    #: with a cache, by timing them (:mod:`runtime.kernels.threads`); None elsewhere.
    decode_threads: ThreadGovernor | None = field(default=None, repr=False)
    prefill_threads: SizedGovernors | None = field(default=None, repr=False)
    #: Loaded with ``reproducible=True`` (:func:`runtime.loader.load.load_model`): a token's
    #: logits have the same bits however it was computed.
    reproducible: bool = False
    #: The model file as loaded (:mod:`runtime.weights.file_guard`); None for a folder.
    file_identity: Any = None
    #: For a GGUF's blocks, the prefill kernels' forms being built after the load
    #: (:mod:`runtime.model.prefill_forms`: ``wait()``, ``state``); None otherwise.
    prefill_forms: PrefillForms | None = field(default=None, repr=False)

    def check_file(self) -> None:
        """Raise :class:`runtime.errors.ModelFileChanged` when the model file changed on disk
        since the load (removed, replaced, resized, modified): one ``stat``, before each reply."""
        from runtime.weights.file_guard import check

        check(self.path, self.file_identity)

    @property
    def name(self) -> str:
        """A short display name (the file or folder name without ``.gguf``)."""
        return self.path.name.removesuffix(".gguf")

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def weights_bytes(self) -> int:
        """Bytes of the weights as loaded (tied matrices counted once; int8 scales included; a
        GGUF's blocks in memory, plus any repack a kernel made: a repacked form that replaced its
        blocks counts once)."""
        from runtime.model.quant_layers import quant_layers

        seen, total = set(), 0
        for p in (*self.decoder.parameters(), *(b for n, b in self.decoder.named_buffers() if n.endswith("weight_scale"))):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        for layer in quant_layers(self.decoder):
            for part in layer.parts:
                if id(part) not in seen:
                    seen.add(id(part))
                    total += part.resident_bytes + part.extra_bytes
        return total

    def new_cache(
        self,
        max_tokens: int | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        limit_bytes: int | None = None,
    ) -> KVCache:
        """An empty KV cache for this model.

        Args:
            max_tokens: capacity in tokens (default and cap: the model's maximum context).
            dtype: cache dtype (``float32``, ``bfloat16``, ``float16``, ``int8``); default
                :attr:`cache_dtype` (float16 for a GGUF's blocks on the CPU), else the compute dtype.
            limit_bytes: optional cap on the cache's allocated bytes.

        Raises:
            ValueError: ``max_tokens`` not positive or past the model's maximum; unknown dtype.
            CacheLimitError: ``limit_bytes`` below one token.
        """
        limit = self.config.max_position_embeddings
        max_tokens = limit if max_tokens is None else int(max_tokens)
        if not 0 < max_tokens <= limit:
            raise ValueError(f"a context of {max_tokens} tokens is outside 1..{limit} (the model's maximum)")
        c = self.config
        return KVCache(
            c.n_layers, c.n_kv_heads, c.head_dim, max_tokens,
            dtype=parse_cache_dtype(dtype) if dtype is not None else self.cache_dtype or self.compute_dtype,
            device=self.device, limit_bytes=limit_bytes, windows=c.windows,
        )

    @torch.inference_mode()
    def logits(self, input_ids: Sequence[int] | torch.Tensor, cache: KVCache | None = None, *, last_only: bool = False) -> torch.Tensor:
        """Float32 logits ``(B, T, V)`` for ``input_ids`` ``(B, T)`` (or a flat list: ``B = 1``).

        With a cache, the tokens are appended to it and attend to everything cached
        before them. ``last_only`` returns ``(B, 1, V)`` (the decode step's need).

        Raises:
            CacheLimitError: the cache cannot take the tokens.
            ValueError: empty input or positions past the model's maximum.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.numel() == 0:
            raise ValueError("input_ids is empty")
        if self._governed and cache is not None and ids.shape[1] > 1:
            return self.prefill_threads.run(lambda: self.decoder(ids, cache, last_only=last_only), size=ids.numel())
        return self.decoder(ids, cache, last_only=last_only)

    def decode_next(self, token: int | torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Float32 logits ``(1, 1, V)`` of one new token appended to ``cache``, through
        :attr:`decode_mode` (the eager path whenever an attention observer is set).
        In ``"graph"`` mode the result is valid until the next call.

        Raises:
            CacheLimitError: the cache cannot take the token.
            ValueError: a position past the model's maximum.
        """
        step = self._decode_step()
        if self._governed:
            return self.decode_threads.run(lambda: step(token, cache))
        return step(token, cache)

    @property
    def _governed(self) -> bool:
        """Whether the thread governors run: on the CPU, except in the compile mode, whose
        kernels keep the thread count they were built with (read, in a background
        compile, from torch's default, which a governor's choice would move)."""
        return self.decode_threads is not None and self.decode_mode != "compile"

    def _decode_step(self) -> DecodeStep:
        if self._step is None or self._step.mode != self.decode_mode:
            self._step = DecodeStep(self.decoder, self.decode_mode)
        return self._step

    def prepare_decode(self, *, background: bool = True):
        """Compile the decode step now rather than on the first message (``"compile"``
        mode; a no-op in the others): in a background thread by default, while
        :meth:`decode_next` decodes eagerly. :attr:`decode_state` says where it stands.

        Returns:
            a ``threading.Event`` set once the compiled step is ready or has failed.
        """
        return self._decode_step().prepare(self.new_cache(self.config.max_position_embeddings), background=background)

    @property
    def decode_state(self) -> str:
        """``"eager"``, ``"static"`` or ``"graph"`` (the mode), or for ``"compile"`` where the
        compiled step stands: ``"compile: none"`` (compiles on the first token),
        ``"compile: compiling"``, ``"compile: ready"``, ``"compile: failed"`` (decodes eagerly)."""
        if self.decode_mode != "compile":
            return self.decode_mode
        return f"compile: {self._decode_step().compile_state}"

    def encode(self, text: str) -> list[int]:
        """Text -> token ids (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text, special tokens dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
