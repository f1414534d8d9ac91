"""``attnchat chat``: one conversation from the command line, as JSON Lines or in the terminal,
and the headless ``--self-test``.

Each ``--prompt`` is one user turn; without one, an interactive terminal chat. Heavy
imports (torch) happen inside the functions, so ``attnchat --help`` stays fast.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from attnchat import cache_options, model_options
from models.sizes import size_text


def add_parser(sub) -> None:
    """Add ``chat`` to the command line's subparsers."""
    chat = sub.add_parser("chat", help="chat from the command line", description=(
        "Each --prompt is one user turn of one conversation. Without --prompt: an interactive terminal chat."))
    chat.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a user turn (repeatable)")
    chat.add_argument("--json", action="store_true", help="one JSON object per turn (JSON Lines)")
    add_generation_args(chat)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    model_options.add_model_arg(p)
    p.add_argument("--system", metavar="TEXT", help="system prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=512, metavar="N", help="most tokens per reply (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P", help="min-p threshold (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R", help="1 = off")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (same seed, same text)")
    p.add_argument("--context", type=int, default=None, metavar="N", help="context length in tokens (default: the model's maximum)")
    model_options.add_cache_dtype_arg(p)
    p.add_argument("--cache-limit-mib", type=float, default=None, metavar="M", help="KV-cache memory limit in MiB")
    p.add_argument("--overflow", choices=["stop", "truncate-middle", "rolling"], default="truncate-middle",
                   help="what happens when the conversation passes the context (default truncate-middle)")
    p.add_argument("--sink-tokens", type=int, default=4, metavar="N", help="tokens the rolling policy always keeps")
    cache_options.add_args(p)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string (repeatable)")
    model_options.add_run_args(p)


def _settings(args: argparse.Namespace):
    from runtime.generate.events import GenerationSettings
    from runtime.generate.sampling import SamplingParams

    limit = None
    if args.cache_limit_mib is not None:
        if args.cache_limit_mib <= 0:
            raise ValueError(f"the KV-cache limit must be positive; got {args.cache_limit_mib} MiB")
        limit = int(args.cache_limit_mib * 1024 * 1024)
    if args.context is not None and args.context <= 0:
        raise ValueError(f"the context length must be a positive number of tokens; got {args.context}")
    if args.cache_dtype is not None:
        from runtime.dtypes import parse_cache_dtype

        parse_cache_dtype(args.cache_dtype)
    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed,
    )
    return GenerationSettings(
        sampling=sampling, max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop),
        context_limit=args.context, overflow=args.overflow, sink_tokens=args.sink_tokens,
        cache_dtype=args.cache_dtype, cache_limit_bytes=limit, **cache_options.settings(args),
    )


def _load(args: argparse.Namespace):
    from attnchat.fetching import model_source
    from runtime import load_model

    return load_model(model_source(args.model), device=args.device, dtype=getattr(args, "dtype", None),
                      reproducible=getattr(args, "reproducible", False))


def _turn_json(model, finish) -> dict[str, Any]:
    out = {"text": finish.text, "finish_reason": finish.reason}
    out.update(finish.stats.to_dict())
    out["device"] = str(model.device)
    out["dtype"] = str(model.dtype).removeprefix("torch.")
    out["compute_dtype"] = str(model.compute_dtype).removeprefix("torch.")
    out["cache_dtype"] = str(getattr(model, "cache_dtype", None) or model.compute_dtype).removeprefix("torch.")
    out["model"] = model.name
    return out


def run(args: argparse.Namespace) -> int:
    for prompt in args.prompt:
        if not prompt.strip():
            raise ValueError("a --prompt is empty or only whitespace, so there is nothing to send; give it some text")
    settings = _settings(args)  # validate before the slow load
    model = _load(args)
    from runtime.generate.session import ChatSession

    if not model.has_chat_template:
        print(f"attnchat: note: {model.name} has no chat template; it runs as plain text "
              f"completion (it continues the prompt)", file=sys.stderr)
    session = ChatSession(model, system_prompt=args.system, settings=settings)
    if not args.prompt:
        return _interactive(session)
    for n, prompt in enumerate(args.prompt, 1):
        finish = session.run(session.send(prompt))
        if finish.reason == "context" and not finish.text:
            # overflow "stop": the conversation fills the context before a reply (was an empty reply).
            raise ValueError(context_full(finish.stats, f"--prompt {n}" if len(args.prompt) > 1 else "the prompt"))
        if args.json:
            print(json.dumps(_turn_json(model, finish), ensure_ascii=False), flush=True)
        else:
            print(finish.text, flush=True)
            cut = cut_note(finish, settings)
            if cut:  # on stderr: stdout stays the reply alone, for a pipe
                print(f"attnchat: note: {cut}", file=sys.stderr, flush=True)
    return 0


def cut_note(finish, settings) -> str:
    """Why a reply stopped before the model ended it, and how to let it go on ("" when the model
    ended it): the length limit (``--max-new-tokens``) or a full context (``--context``)."""
    if finish.reason == "length":
        return (f"the reply stopped at the length limit ({settings.max_new_tokens:,} tokens); "
                "raise --max-new-tokens for a longer one")
    if finish.reason == "context":
        return (f"the reply stopped because the context ({finish.stats.context_limit:,} tokens) is full; "
                "give a longer --context")
    return ""


def context_full(stats, what: str) -> str:
    """One line: the context filled up before a reply to ``what`` (overflow ``stop``), and the ways on."""
    return (f"the context is full: the conversation takes {stats.prompt_tokens:,} of its "
            f"{stats.context_limit:,} tokens, leaving no room for a reply to {what}; give a longer "
            "--context, or --overflow truncate-middle (or rolling) to drop the oldest tokens")


def _interactive(session) -> int:
    """A terminal chat: streamed replies, /regenerate, /reset, /exit; Ctrl-C stops the reply, not the program."""
    from runtime.generate.events import Finish, TextPiece

    generating = False

    def on_sigint(signum, frame):
        if generating:
            session.cancel()
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    print(f"attnchat — {session.model.name} on {session.model.device}. /regenerate writes the last reply again, "
          "/reset clears, /exit quits, Ctrl-C stops a reply.")
    try:
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                session.reset()
                print("(conversation cleared)")
                continue
            if text == "/regenerate" and not any(m.role == "assistant" for m in session.messages):
                print("(no reply to write again yet)")
                continue
            generating = True
            try:
                # /regenerate: the prompt comes from the cache with the logits its prefill left, so at
                # temperature 0 the reply is the same (--reproducible: also read from scratch)
                for ev in session.regenerate() if text == "/regenerate" else session.send(line):
                    if isinstance(ev, TextPiece):
                        sys.stdout.write(ev.text)
                        sys.stdout.flush()
                    elif isinstance(ev, Finish) and ev.reason == "context" and not ev.text:
                        print(f"({context_full(ev.stats, 'this message')}; or /reset to start over)")
                    elif isinstance(ev, Finish):
                        s = ev.stats
                        note = {"cancelled": " (stopped)", "length": " (length limit)", "context": " (context full)"}.get(ev.reason, "")
                        print(f"{note}\n[{s.completion_tokens} tokens, {s.decode_tokens_per_s:.1f} tok/s, "
                              f"KV cache {size_text(s.kv_cache.get('used_bytes', 0))}]")
            finally:
                generating = False
    finally:
        signal.signal(signal.SIGINT, previous)


def self_test(args: argparse.Namespace) -> int:
    from runtime.generate.events import GenerationSettings
    from runtime.generate.session import ChatSession

    model = _load(args)
    session = ChatSession(model, settings=GenerationSettings(max_new_tokens=24))
    finish = session.run(session.send("What is the capital of France?"))
    ok = "paris" in finish.text.lower()
    print(f"self-test {'passed' if ok else 'FAILED'}: {model.name} on {model.device} answered {finish.text!r}")
    return 0 if ok else 1


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive number")
    return value
