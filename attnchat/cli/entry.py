"""The ``attnchat`` command line: the app, ``chat``, ``models``.

Errors a user can cause exit with status 2 and one line on stderr (what was wrong,
what to do); anything unexpected writes its traceback to the log folder and prints
one line pointing there. Heavy imports (torch) happen only in the commands that
need them, so ``attnchat models ...`` and ``--help`` stay fast.
"""
from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from typing import Sequence

from attnchat.bench import command as bench
from attnchat.cli import cache_eval as cache_eval_cmd
from attnchat.cli import chat as chat_cmd
from attnchat.cli import formula as formula_cmd
from attnchat.cli import heads as heads_cmd
from attnchat.cli import memory as memory_cmd
from attnchat.cli import models as models_cmd
from attnchat.server import command as serve_cmd

EXIT_USER_ERROR = 2
log = logging.getLogger("attnchat")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # Always "attnchat: error:" (subcommands too), the prefix every user error has.
        self.exit(EXIT_USER_ERROR, f"attnchat: error: {message} (see {self.prog} --help)\n")

    def unknown(self, extra: Sequence[str]) -> None:
        """Exit 2 naming the arguments this parser does not take, and the nearest option
        it does take when one is close (``--max-tokens``: did you mean ``--max-new-tokens``?)."""
        near = next((difflib.get_close_matches(a.split("=")[0], _long_options(self), n=1, cutoff=0.7)
                     for a in extra if a.startswith("--")), [])
        hint = f"; did you mean {near[0]}?" if near else ""
        if self.prog == "attnchat chat" and "--terminal" in extra:
            hint = "; `attnchat chat` without --prompt is the terminal chat (or `attnchat --terminal`)"
        self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


def _takes_value(parser: argparse.ArgumentParser, option: str) -> bool | None:
    """Whether ``option`` (``--name`` or ``--name=value``) of ``parser`` reads the next argument
    as its value; None when the parser has no such option."""
    name, eq, _ = option.partition("=")
    action = parser._option_string_actions.get(name)
    if action is None:
        return None
    return not eq and action.nargs != 0


def _after_app_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """The index of the first argument that is neither one of the app's own options (``--model
    SRC``, ``--terminal``, ...) nor such an option's value: where a command would stand."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        value = _takes_value(parser, argv[i])
        if value is None:
            break
        i += 2 if value else 1
    return i


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` ran: ``attnchat models list``'s for ``models list``."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, sub.dest, None) if sub is not None else None
        if name not in (sub.choices if sub is not None else {}):
            return parser
        parser = sub.choices[name]


def _app_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` as the parser should read it: ``attnchat --terminal [chat options]`` is the
    terminal chat, ``attnchat chat [chat options]`` (the options people try there, as the
    README's "options of chat also apply to the app" says); a chat option given to the window
    is one line saying where it belongs.

    Raises:
        SystemExit: status 2, a chat option without ``--terminal`` (the window takes its
            generation settings from Edit > Settings).
    """
    commands = parser.commands  # type: ignore[attr-defined]
    i = _after_app_options(parser, argv)
    if i == len(argv) or argv[i] in commands or not argv[i].startswith("-"):
        return argv  # a command, nothing more, or a stray word (argparse names it)
    if _takes_value(commands["chat"], argv[i]) is None:
        # --terminal takes chat's options: name the nearest of those and chat's --help.
        (commands["chat"] if "--terminal" in argv else parser).unknown([a for a in argv[i:] if a.startswith("-")])
    option = argv[i].split("=")[0]
    if "--self-test" in argv[:i] or any(a.split("=")[0] == "--screenshot" for a in argv[:i]):
        parser.error(f"{option} is an option of the terminal chat; --self-test and --screenshot take only "
                     "--model and --device")
    if "--terminal" in argv:
        return ["chat"] + [a for a in argv if a != "--terminal"]
    parser.error(f"{option} is an option of the terminal chat, not the window: `attnchat --terminal "
                 f"{' '.join(argv[i:])}`; the window has it in Edit > Settings")
    return argv  # not reached: error() exits


def _quiet_libraries() -> None:
    """No progress bars or library warnings on the user's terminal; the libraries never reach a
    model hub (only attnchat's own Hub commands do: models.hub.api.libraries_offline)."""
    from models.hub.api import libraries_offline

    os.environ.setdefault("TQDM_DISABLE", "1")
    libraries_offline()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnchat", description="A local chat app that shows its KV cache and attention.")
    parser.add_argument("--model", metavar="SRC", help="a .gguf file or a model folder")
    parser.add_argument("--self-test", action="store_true", help="load the model, answer one question, exit 0 if right")
    parser.add_argument("--screenshot", metavar="DIR", help="save screenshots of the app's windows to DIR and exit")
    parser.add_argument("--terminal", action="store_true", help="chat in the terminal instead of the window (it takes the options of `attnchat chat`)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    parser.commands = sub.choices  # type: ignore[attr-defined]
    chat_cmd.add_parser(sub)
    models_cmd.add_parser(sub)
    memory_cmd.add_parser(sub)
    heads_cmd.add_parser(sub)
    formula_cmd.add_parser(sub)
    bench.add_parser(sub)
    cache_eval_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    return parser


def _serve_in_process(model, **kwargs):
    """:func:`attnchat.server.in_process.for_window`, imported when first used (it imports torch)."""
    from attnchat.server.in_process import for_window

    return for_window(model, **kwargs)


def _app(args: argparse.Namespace) -> int:
    try:
        from desktop.launch import main as desktop_main  # the window, when installed
    except ImportError:
        log.warning("the desktop app is not available; using the terminal", exc_info=True)
        desktop_main = None
    if desktop_main is not None and not args.terminal:
        # the window; --self-test and --screenshot run headless there. Its Server > Serve serves the
        # window's own model from this process: the desktop may not import attnchat, so it gets the maker
        return desktop_main(args, serve_factory=_serve_in_process)
    if args.self_test:
        return chat_cmd.self_test(args)
    from models import fetch

    fetch.ensure_default() if args.model is None else None
    chat_args = build_parser().parse_args(["chat"] + (["--model", args.model] if args.model else []) + ["--device", args.device])
    return chat_cmd.run(chat_args)


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_libraries()
    parser = build_parser()
    argv = _app_argv(parser, list(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command's own parser, so its hint is `attnchat chat --help`
        _command_parser(parser, args).unknown(extra)
    from models import logfile as logfile_mod

    logfile = logfile_mod.to_file()  # None when the log folder cannot be written: run on without
    # A library's warning (numpy's "overflow encountered" ...) goes to the log, never the
    # user's terminal; with no log file, nowhere (not logging's last-resort stderr handler).
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").addHandler(logging.NullHandler())
    try:
        if args.command == "models":
            return models_cmd.run(args)
        if args.command == "chat":
            return chat_cmd.run(args)
        if args.command == "memory":
            return memory_cmd.run(args)
        if args.command == "heads":
            return heads_cmd.run(args)
        if args.command == "formula":
            return formula_cmd.run(args)
        if args.command == "serve":
            return serve_cmd.run(args)
        if args.command == "bench":
            return bench.run(args)
        if args.command == "cache-eval":
            return cache_eval_cmd.run(args)
        return _app(args)
    except KeyboardInterrupt:
        print("attnchat: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line for the user, the traceback for the log
        from models import FetchError

        user_error = isinstance(e, (ValueError, FetchError))
        try:
            from runtime.errors import AttnchatError

            user_error = user_error or isinstance(e, AttnchatError)
        except ImportError:
            pass
        log.exception("command failed")
        first = (str(e).strip().splitlines() or [""])[0]  # one line, whatever the exception holds
        if user_error:
            print(f"attnchat: error: {first or type(e).__name__}", file=sys.stderr)
            return EXIT_USER_ERROR
        where = f"; details in {logfile}" if logfile else ""
        print(f"attnchat: internal error: {type(e).__name__}: {first}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
