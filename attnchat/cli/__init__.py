"""The ``attnchat`` command line: :func:`main` parses and dispatches; one module per command
(:mod:`.chat`, :mod:`.models`, :mod:`.memory`, :mod:`.heads`, :mod:`.formula`); ``serve`` and
``bench`` are :mod:`attnchat.server.command` and :mod:`attnchat.bench.command`.
"""
from attnchat.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
