"""``--cache-policy`` and ``--cache-budget``: the options ``attnchat chat`` and ``attnchat serve``
share (below both; no torch at import)."""
from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    """``--cache-policy`` and ``--cache-budget`` (the chat and the server take both)."""
    p.add_argument("--cache-policy", default="none", metavar="P",
                   help="which tokens the KV cache evicts once it holds its budget: none (default), sinks-window, "
                        "h2o, snapkv, tova, key-norm (docs/cache-policies.md)")
    p.add_argument("--cache-budget", default=None, metavar="N",
                   help="what a cache policy keeps: tokens (512) or MiB (24MiB)")


def settings(args: argparse.Namespace) -> dict:
    """GenerationSettings' cache-policy fields from ``--cache-policy`` / ``--cache-budget``.

    Raises:
        ValueError: an unknown policy, a malformed budget, a policy without a budget.
    """
    from runtime import CACHE_POLICIES

    if args.cache_policy not in CACHE_POLICIES:
        raise ValueError(f"unknown --cache-policy {args.cache_policy!r}; use one of {', '.join(CACHE_POLICIES)}")
    tokens, nbytes = parse_budget(args.cache_budget) if args.cache_budget is not None else (None, None)
    if args.cache_policy != "none" and args.cache_budget is None:
        raise ValueError(f"--cache-policy {args.cache_policy} needs --cache-budget (tokens such as 512, or MiB such as 24MiB)")
    return dict(cache_policy=args.cache_policy, cache_budget=tokens, cache_budget_bytes=nbytes)


def parse_budget(text: str) -> tuple[int | None, int | None]:
    """A cache budget as the command line takes it: ``"512"`` (tokens) -> ``(512, None)``,
    ``"24MiB"`` / ``"24M"`` (mebibytes) -> ``(None, 25165824)``.

    Raises:
        ValueError: anything else, or a budget below 1 token or byte.
    """
    t = text.strip()
    unit = next((u for u in ("MiB", "M") if t.endswith(u)), None)
    try:
        value = float(t[: -len(unit)]) if unit else int(t)
    except ValueError:
        raise ValueError(f"a cache budget is a number of tokens (512) or of MiB (24MiB); got {text!r}") from None
    n = int(value * 2**20) if unit else int(value)
    if n < 1:
        raise ValueError(f"a cache budget must be positive; got {text!r}")
    return (None, n) if unit else (n, None)
