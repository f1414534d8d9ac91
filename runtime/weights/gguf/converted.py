"""A GGUF file through transformers' GGUF reader: its config, tokenizer and tensors, and the
converted config, tokenizer and decoder weights kept in the user's cache folder.

Must not import Qt. A GGUF's tokenizer is read from the file alone, never from its folder
(:func:`gguf_only`); ``trust_remote_code`` is always False.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from runtime.config.model import ModelConfig
from runtime.errors import ModelLoadError, UnsupportedModelError
from runtime.weights.convert import decoder_state
from runtime.weights.gguf import fast_tokenizer
from runtime.weights.checked import check_gguf_file, check_gguf_metadata
from runtime.weights.sources import model_config, one_line

log = logging.getLogger(__name__)


@contextlib.contextmanager
def gguf_only(path: Path):
    """(folder, file) naming ``path`` from a fresh, private, empty folder of ours.

    transformers reads tokenizer_config.json and other files from the folder it is given
    beside a ``gguf_file``; one with an ``auto_map`` makes it offer to run the folder's
    Python. A GGUF carries its own config and tokenizer, so nothing from its folder is read.
    """
    with tempfile.TemporaryDirectory(prefix="attnchat-gguf-") as empty:  # mode 0700
        yield empty, str(path.resolve())


def gguf_cache_dir(path: Path) -> Path | None:
    """Where the GGUF's converted config and tokenizer are kept (None if unavailable).

    Keyed by the file's path, size, mtime and the transformers version, so a changed
    file or library rebuilds it. The version is read from the package's metadata: importing
    transformers for it would cost a second of a load that needs nothing else of it.
    """
    from models import paths

    try:
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_transformers_version()}"
        return paths.cache_dir() / "gguf" / hashlib.sha1(key.encode()).hexdigest()[:16]
    except OSError:
        return None


@functools.cache
def _transformers_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("transformers")


#: Our own config, kept beside the converted tokenizer: reading it needs no transformers
#: config class (importing one costs about a second: it pulls in torch.distributed).
#: v2: RoPE variants, sliding windows and the Gemma/Qwen3 pieces (a v1 file lacks them);
#: v3: the RoPE a GGUF says and transformers' reader drops (a v2 file of a Llama 3.x,
#: Phi-3.5/Phi-4-mini or Gemma 3 4B GGUF runs the wrong RoPE: ``gguf.config.dropped_facts``).
CONFIG_FILE = "attnchat-model-config-v3.json"


#: Tokenizer classes whose saved ``tokenizer.json`` alone gives the same tokenizer: the fast
#: tokenizer's own classes (transformers 5 and 4) and Gemma's, whose class only rebuilds from
#: the vocabulary what its tokenizer.json already holds (2.3 s of a 262,144-token vocabulary
#: rebuilt on every load, AMD EPYC Zen 4; a test checks the two give the same ids, text and
#: special tokens on the real Gemma 3 file).
_FAST_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", "GemmaTokenizer"}


def read_cached(cached: Path | None):
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


def cached_model_config(cached: Path | None) -> ModelConfig | None:
    """The :data:`CONFIG_FILE` kept in the cache, or None (missing or unreadable)."""
    if cached is None or not (cached / CONFIG_FILE).exists():
        return None
    try:
        return ModelConfig.from_dict(json.loads((cached / CONFIG_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        log.warning("GGUF cache %s: %s unreadable", cached, CONFIG_FILE, exc_info=True)
        return None


#: tokenizer_config.json keys that say where a tokenizer came from, not what it is.
_PROVENANCE_KEYS = ("tokenizer_class", "backend", "is_local", "local_files_only", "auto_map")


def _read_cached_fast(cached: Path | None):
    """(ModelConfig, tokenizer) from :data:`CONFIG_FILE` and the cached fast tokenizer,
    or (None, None) when either is missing or unreadable (the slow path then runs).

    The fast tokenizer is built from its files directly: ``tokenizers`` reads tokenizer.json
    (in Rust), the special tokens come from tokenizer_config.json, the chat template from
    chat_template.jinja. transformers' ``from_pretrained`` would also parse the whole
    tokenizer.json again in Python for its added tokens, which the Rust tokenizer already
    holds (Gemma 3's 33 MB file: 10.5 s against 2.4 s on a busy 2-core AMD EPYC Zen 4; a
    test checks both give the same ids, text and special tokens on the real files). No
    transformers config class is built either.
    """
    cfg = cached_model_config(cached)
    if cfg is None or not (cached / "tokenizer.json").exists():
        return None, None
    try:
        kwargs = json.loads((cached / "tokenizer_config.json").read_text(encoding="utf-8"))
        if kwargs.get("tokenizer_class") not in _FAST_TOKENIZER_CLASSES:
            return None, None
        for key in _PROVENANCE_KEYS:
            kwargs.pop(key, None)
        template = cached / "chat_template.jinja"
        if "chat_template" not in kwargs and template.exists():
            kwargs["chat_template"] = template.read_text(encoding="utf-8")
        fast = fast_tokenizer.read(cached / "tokenizer.json", {**kwargs, "name_or_path": str(cached)})
        if fast is not None:  # no transformers import on a load (a second of the default model's)
            if not (cached / fast_tokenizer.COMPACT_MARK).exists():   # a folder kept before the compact form
                fast_tokenizer.compact_merges(cached / "tokenizer.json", fast.backend_tokenizer)
            return cfg, fast
        from transformers import PreTrainedTokenizerFast

        return cfg, PreTrainedTokenizerFast(tokenizer_file=str(cached / "tokenizer.json"), name_or_path=str(cached),
                                            **kwargs)
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
        if (tmp / "tokenizer.json").exists():
            fast_tokenizer.compact_merges(tmp / "tokenizer.json", getattr(tokenizer, "backend_tokenizer", None))
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


def _read_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    check_gguf_file(path)
    check_gguf_metadata(path)
    cached = gguf_cache_dir(path)
    hf_config, tokenizer = read_cached(cached)
    if hf_config is None:
        try:
            with gguf_only(path) as (folder, name):
                hf_config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        except ValueError as e:
            if "not supported" in str(e) or "architecture" in str(e):
                raise UnsupportedModelError(f"{path.name}: {one_line(e).rstrip('.')}; attnchat runs Llama-family and GPT-2 models") from None
            raise ModelLoadError(f"{path.name} could not be read as GGUF ({one_line(e)}); the file may be truncated: download it again") from None
        except Exception as e:
            raise ModelLoadError(f"{path.name} could not be read as GGUF ({type(e).__name__}: {one_line(e)}); the file may be truncated: download it again") from None
    cfg = model_config(path, hf_config)
    try:
        if tokenizer is None:
            with gguf_only(path) as (folder, name):
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
        raise ModelLoadError(f"{path.name} could not be read ({type(e).__name__}: {one_line(e)}); the file may be truncated or damaged: download it again") from None
    return cfg, tokenizer, parsed["tensors"]


#: Bump when the decoder's tensor names or fusion change: old converted files are ignored.
WEIGHTS_LAYOUT_VERSION = 1


def _converted_file(cached: Path | None, wdtype: torch.dtype) -> Path | None:
    if cached is None or os.environ.get("ATTNCHAT_WEIGHT_CACHE", "1") == "0":
        return None
    return cached / f"decoder-v{WEIGHTS_LAYOUT_VERSION}-{str(wdtype).removeprefix('torch.')}.safetensors"


def load_gguf(path: Path, wdtype: torch.dtype, keep: bool = True):
    """(config, tokenizer, decoder state) of a GGUF file.

    The first load dequantizes through transformers (seconds: the GGUF's metadata is
    parsed in Python) and, with ``keep``, keeps the decoder's converted weights as a
    safetensors file in the user cache folder, beside the converted config and tokenizer;
    later loads read that file (well under a second). ``ATTNCHAT_WEIGHT_CACHE=0`` turns it
    off. ``keep=False`` (a quantized file: its float copy would be twice to eight times its
    size on disk) widens in memory only, at every load.
    """
    from safetensors.torch import load_file, save_file

    check_gguf_file(path)
    cached = gguf_cache_dir(path)
    converted = _converted_file(cached, wdtype) if keep else None
    if converted is not None and converted.exists():
        cfg, tokenizer = _read_cached_fast(cached)
        if cfg is None:
            hf_config, tokenizer = read_cached(cached)
            cfg = model_config(path, hf_config) if hf_config is not None else None
            if cfg is not None:
                _write_model_config(cached, cfg)
        if cfg is not None:
            try:
                return cfg, tokenizer, load_file(str(converted))
            except Exception:
                log.warning("converted weights %s unusable, converting again", converted, exc_info=True)
    cfg, tokenizer, tensors = _read_gguf(path, wdtype)
    state = decoder_state(path, cfg, tensors, wdtype)
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
