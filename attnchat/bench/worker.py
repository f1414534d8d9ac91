"""One benchmark run of one engine, in its own process: prints one JSON object.

``python -m attnchat.bench.worker --engine ours|transformers|llamacpp --model PATH [...]``

Every engine gets the same seeded random token ids (special tokens excluded) and is
measured the same way:

- ``load_s``: wall time from nothing to a model ready to run. Ours then waits for the
  prefill kernels' forms it builds after a load (:mod:`runtime.model.prefill_forms`), so
  the figures below run the chosen kernels; ``first_reply_s`` includes that wait.
- ``ttft_s`` / ``prefill_tokens_per_s``: a cold prompt of ``--prefill-tokens`` ids to
  its first generated token.
- ``decode_tokens_per_s[depth]``: after a prompt of ``depth`` ids, ``--decode-tokens``
  greedy tokens; the steady rate from the second decoded token on, (tokens - 2) /
  (time of last - time of second), so one-off costs of the first step (a CUDA graph's
  capture, a compiled graph's first shape) count in no engine's rate.
- ``followup_ttft_s``: a conversation of ``--followup-context`` ids already processed,
  then ``--followup-tokens`` more: time to the first token of the reply. Ours reuses
  its KV cache (that is what a chat session does); transformers' ``generate`` and
  llama.cpp re-process the whole conversation, as chat front ends built on them do.
- ``peak_rss_bytes``: the process's peak resident memory (getrusage); on CUDA also
  ``peak_gpu_bytes`` (``torch.cuda.max_memory_allocated``).

``--device cuda`` runs the engines on the GPU; ``--random-weights`` replaces the model
by seeded random weights of its shape (speed does not depend on the values; the GPU
machine may not have the model file).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path



def _quiet_libraries() -> None:
    """No progress bars, library warnings or hub requests in the worker's process. Called by
    :func:`main`, not at import: ``attnchat bench`` imports this module into the command line's
    process, whose own switch (``models.hub.api.libraries_offline``) must see the user's
    environment, not one this module changed."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def random_ids(vocab_size: int, special: set[int], n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    out = []
    while len(out) < n:
        t = rng.randrange(vocab_size)
        if t not in special:
            out.append(t)
    return out


# ---- ours ------------------------------------------------------------------------------
class Ours:
    name = "ours"

    def __init__(self, path: str, dtype: str | None, device: str = "cpu", decode: str | None = None,
                 reproducible: bool = False):
        from runtime import load_model

        self.model = load_model(path, device=device, dtype=dtype, decode=decode, reproducible=reproducible)
        self.decode_mode = self.model.decode_mode
        self.vocab = self.model.config.vocab_size
        self.special = set(self.model.tokenizer.all_special_ids)
        weights, compute = (str(d).removeprefix("torch.") for d in (self.model.dtype, self.model.compute_dtype))
        self.dtype = weights if weights == compute else f"{weights} weights, {compute} compute"
        self.kv_bytes_per_token = self.model.new_cache(1).bytes_per_token
        k, q = self.model.kernels, self.model.quant_kernels
        self.kernels = None if k is None else {"decode": k.decode, "prefill": k.prefill, "timings_us": k.timings_us}
        if q is not None:  # a GGUF's own blocks: a pair of kernels per block type
            self.kernels = {"decode": {t: d for t, (d, _) in q.kernels.items()},
                            "prefill": {t: p for t, (_, p) in q.kernels.items()}, "timings_us": q.timings_us}
        self.cache = None

    @property
    def threads(self) -> dict | None:
        """Where the thread governors stand (:mod:`runtime.kernels.threads`), None off the CPU."""
        m = self.model
        if m.decode_threads is None or self.decode_mode == "compile":  # the compile mode is not governed
            return None
        return {"decode": m.decode_threads.describe(), "prefill": m.prefill_threads.describe()}

    @property
    def compile_seconds(self) -> float | None:
        """The compiled decode step's first build (``"compile"`` mode), else None."""
        step = self.model._step
        return None if step is None or self.decode_mode != "compile" else step.compile_seconds

    def _prefill(self, ids: list[int], chunk: int = 512):
        logits = None
        for i in range(0, len(ids), chunk):
            logits = self.model.logits(ids[i : i + chunk], self.cache, last_only=True)
        return int(logits[0, -1].argmax())

    def generate(self, ids: list[int], n: int, *, reuse: bool = False) -> list[float]:
        """Timestamps (perf_counter) of each generated token; starts cold unless ``reuse``."""
        if not reuse or self.cache is None:
            self.cache = self.model.new_cache(self.model.config.max_position_embeddings)
        stamps = []
        tok = self._prefill(ids)
        stamps.append(time.perf_counter())
        for _ in range(n - 1):
            logits = self.model.decode_next(tok, self.cache)  # the app's decode mode
            tok = int(logits[0, -1].argmax())  # the token on the host: a sync, as in a chat
            stamps.append(time.perf_counter())
        return stamps

    def followup(self, context: list[int], turn: list[int]) -> float:
        self.generate(context, 1)  # the conversation so far, cached
        self.cache.crop(len(context))
        t0 = time.perf_counter()
        self.generate(turn, 1, reuse=True)
        return time.perf_counter() - t0


# ---- transformers ----------------------------------------------------------------------
class Transformers:
    name = "transformers"

    def __init__(self, path: str, dtype: str | None, device: str = "cpu", compiled: bool = False):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = device
        # compiled: a static KV cache, which transformers' generate compiles the forward
        # pass for (torch.compile, "reduce-overhead": CUDA graphs underneath) on a GPU.
        self.generate_kwargs = {"cache_implementation": "static"} if compiled else {}
        tdtype = getattr(torch, dtype or "float32")
        if path.endswith(".gguf"):
            from transformers import GgufConfig

            d, f = os.path.split(path)
            self.model = AutoModelForCausalLM.from_pretrained(
                d, gguf_file=f, quantization_config=GgufConfig(dequantize=True), dtype=tdtype, attn_implementation="sdpa",
                trust_remote_code=False)
            tok = AutoTokenizer.from_pretrained(d, gguf_file=f, trust_remote_code=False)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype, attn_implementation="sdpa",
                                                              trust_remote_code=False)
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        self.model.to(device).eval()
        cfg = self.model.config
        self.vocab = cfg.vocab_size
        self.special = set(tok.all_special_ids)
        self.dtype = dtype or "float32"
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_bytes_per_token = 2 * cfg.num_hidden_layers * heads * head_dim * tdtype.itemsize

    def generate(self, ids: list[int], n: int, *, reuse: bool = False) -> list[float]:
        from transformers.generation.streamers import BaseStreamer

        stamps: list[float] = []

        class Clock(BaseStreamer):
            first = True

            def put(self, value):
                if self.first:  # generate() first pushes the prompt
                    self.first = False
                    return
                stamps.append(time.perf_counter())

            def end(self):
                pass

        x = self.torch.tensor([ids], device=self.device)
        with self.torch.no_grad():
            self.model.generate(x, attention_mask=self.torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, streamer=Clock(), pad_token_id=0, **self.generate_kwargs)
        return stamps

    def followup(self, context: list[int], turn: list[int]) -> float:
        t0 = time.perf_counter()
        self.generate(context + turn, 1)
        return time.perf_counter() - t0


# ---- llama.cpp -------------------------------------------------------------------------
class LlamaCpp:
    name = "llamacpp"

    def __init__(self, path: str, dtype: str | None, device: str = "cpu"):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_ctx=8192, n_threads=os.cpu_count() or 2, verbose=False)
        self.vocab = self.llm.n_vocab()
        self.special = {self.llm.token_bos(), self.llm.token_eos()}
        self.dtype = "gguf"
        self.kv_bytes_per_token = None

    def generate(self, ids: list[int], n: int, *, reuse: bool = False) -> list[float]:
        stamps = []
        self.llm.reset()
        for i, _tok in enumerate(self.llm.generate(ids, top_k=1, temp=0.0, reset=True)):
            stamps.append(time.perf_counter())
            if i + 1 >= n:
                break
        return stamps

    def followup(self, context: list[int], turn: list[int]) -> float:
        t0 = time.perf_counter()
        self.generate(context + turn, 1)
        return time.perf_counter() - t0


ENGINES = {
    "ours": Ours,
    "ours-eager": lambda path, dtype, device: Ours(path, dtype, device, decode="eager"),
    "ours-compile": lambda path, dtype, device: Ours(path, dtype, device, decode="compile"),
    "ours-reproducible": lambda path, dtype, device: Ours(path, dtype, device, reproducible=True),
    "transformers": Transformers,
    "transformers-compiled": lambda path, dtype, device: Transformers(path, dtype, device, compiled=True),
    "llamacpp": LlamaCpp,
}


def random_model_folder(source: str | None, seed: int = 0) -> str:
    """A folder with seeded random weights of ``source``'s shape (the default model's
    when None) and its tokenizer, in transformers' layout; made once per shape in the
    temporary folder. Speed does not depend on the weights' values."""
    import hashlib
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from models.catalog import DEFAULT_MODEL
    from models.store import installed_path
    from runtime import read_config

    if source is None and installed_path(DEFAULT_MODEL) is None:
        # No file to read the shape from (a GPU machine without the model): the default
        # model's shape, SmolLM2-135M-Instruct's config.json.
        shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    else:
        cfg = read_config(source)
        if cfg.family != "llama":
            raise ValueError("--random-weights builds Llama-family shapes only")
        shape = dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
            eos_token_id=list(cfg.eos_token_ids)[0] if cfg.eos_token_ids else None,
        )
    key = hashlib.sha1(repr((sorted(shape.items()), seed)).encode()).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), f"attnchat-bench-random-{key}")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    hf = LlamaConfig(**shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf, trust_remote_code=False).float()
    tmp = folder + f".tmp{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    if source is not None and os.path.isdir(source):
        AutoTokenizer.from_pretrained(source, trust_remote_code=False).save_pretrained(tmp)
    else:
        _stand_in_tokenizer().save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


def _stand_in_tokenizer():
    """A small byte-level tokenizer: the benchmark feeds token ids, never text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def _process_seconds() -> float:
    """Seconds since this process started, to the kernel's clock tick (10 ms).

    On Linux from ``/proc/self/stat``'s start time (clock ticks since boot) against
    ``CLOCK_BOOTTIME``: psutil's creation time adds the boot time, which ``/proc/stat`` gives
    in whole seconds, so its age of a process is off by up to a second (it read 0.60 s for a
    process 0.03 s old). Elsewhere psutil's."""
    stat = Path("/proc/self/stat")
    if hasattr(time, "CLOCK_BOOTTIME") and stat.exists():
        fields = stat.read_text().rsplit(")", 1)[1].split()   # after the command's name, which may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")    # field 22: starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    import psutil

    return time.time() - psutil.Process().create_time()


def measure(args: argparse.Namespace) -> dict:
    import torch

    cuda = args.device.startswith("cuda")
    t0 = time.perf_counter()
    engine = ENGINES[args.engine](args.model, args.dtype, args.device)
    load_s = time.perf_counter() - t0
    forms = getattr(getattr(engine, "model", None), "prefill_forms", None)
    if forms is not None:  # ours: the figures below on the chosen kernels, not beside their build
        forms.wait()
    ids = random_ids(engine.vocab, engine.special, max([args.prefill_tokens, args.followup_context + args.followup_tokens] + args.depths), args.seed)
    # Warm-up (first-call costs: allocator, kernels), then the figures. The first call's first
    # token is the process's first reply: seconds since the process started (imports, load).
    for i in range(2):  # ours: the thread governors' first tries (prefill and decode) happen here
        stamps = engine.generate(ids[:16], 4)
        if i == 0:
            first_reply = stamps[0] - time.perf_counter() + _process_seconds()
    t = time.perf_counter()
    first = engine.generate(ids[: args.prefill_tokens], 1)[0]
    ttft = first - t
    decode = {}
    for depth in args.depths:
        stamps = engine.generate(ids[:depth], args.decode_tokens)
        decode[str(depth)] = (len(stamps) - 2) / (stamps[-1] - stamps[1]) if len(stamps) > 2 else 0.0
    followup = engine.followup(ids[: args.followup_context], ids[args.followup_context : args.followup_context + args.followup_tokens])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    cache_bytes = None
    if os.environ.get("ATTNCHAT_CACHE_DIR"):  # a cold run's own cache folder: what the run left there
        cache_bytes = sum(p.stat().st_size for p in Path(os.environ["ATTNCHAT_CACHE_DIR"]).rglob("*") if p.is_file())
    prof = None
    if getattr(args, "profile", False) and hasattr(engine, "model"):
        from attnchat.bench.profile import profile

        prof = profile(engine.model)
    return {
        "profile": prof,
        "engine": args.engine, "dtype": engine.dtype, "device": args.device,
        "decode_mode": getattr(engine, "decode_mode", None), "load_s": load_s, "ttft_s": ttft,
        "prefill_tokens_per_s": args.prefill_tokens / ttft if ttft > 0 else 0.0,
        "decode_tokens_per_s": decode, "followup_ttft_s": followup, "peak_rss_bytes": rss,
        "kv_bytes_per_token": engine.kv_bytes_per_token, "kernels": getattr(engine, "kernels", None),
        "compile_s": getattr(engine, "compile_seconds", None), "threads": getattr(engine, "threads", None),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "cache_bytes": cache_bytes, "first_reply_s": first_reply,
    }


def main(argv=None) -> int:
    _quiet_libraries()
    p = argparse.ArgumentParser(prog="attnchat.bench.worker")
    p.add_argument("--engine", choices=sorted(ENGINES), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--depths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 1024])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--followup-context", type=int, default=1000)
    p.add_argument("--followup-tokens", type=int, default=20)
    args = p.parse_args(argv)
    if args.random_weights:
        args.model = random_model_folder(None if args.model == "default" else args.model)
    try:
        figures = measure(args)
    except Exception as e:
        if not _users_error(e):
            raise
        print((str(e).strip().splitlines() or [type(e).__name__])[0], file=sys.stderr)
        return USER_ERROR
    print(json.dumps(figures))
    return 0


#: The worker's exit status when the model or its settings are at fault (one line on stderr, no
#: traceback): ``attnchat bench`` then says that line as the user's error.
USER_ERROR = 2


def _users_error(e: Exception) -> bool:
    """Whether ``e`` is one of attnchat's own errors about the input (a model that cannot load).
    llama.cpp's worker runs in its own environment, where runtime may be absent."""
    try:
        from runtime.errors import AttnchatError
    except ImportError:
        return False
    return isinstance(e, AttnchatError)


if __name__ == "__main__":
    sys.exit(main())
