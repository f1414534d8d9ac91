"""The walk a model load takes through attnchat's own modules, for reading the loader's shape.

    .venv/bin/python scripts/load_walk.py [--model SRC] [--every-call] [--list]

Traces ``runtime.load_model(SRC)`` (default: the default model) with ``sys.setprofile``. Each
function of ``runtime/`` or ``models/`` counts once, at its first call (what a reader follows
through the code; ``--every-call`` counts every call, loops included). Consecutive such calls
in one file are one *stay*; *rooms* are the distinct files; *returns* are stays in a file the
walk had already left (stays minus rooms). Prints ``stays rooms returns`` and, with
``--list``, the stays in order with their function counts. No timing: the figures do not
depend on the machine's load.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PACKAGES = tuple(str(ROOT / p) + "/" for p in ("runtime", "models"))


def walk(source: str | None, every_call: bool = False) -> list[tuple[str, int]]:
    """``(file relative to the repository, functions entered)`` per stay, in order."""
    import runtime

    seen: set = set()
    stays: list[list] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGES) or (not every_call and code in seen):
            return
        seen.add(code)
        room = str(Path(code.co_filename).relative_to(ROOT))
        if stays and stays[-1][0] == room:
            stays[-1][1] += 1
        else:
            stays.append([room, 1])

    sys.setprofile(profile)
    try:
        runtime.load_model(source)
    finally:
        sys.setprofile(None)
    return [(r, n) for r, n in stays]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file or model folder (default: the default model)")
    ap.add_argument("--every-call", action="store_true", help="count every call, not each function once")
    ap.add_argument("--list", action="store_true", help="print the stays in order")
    args = ap.parse_args(argv)
    stays = walk(args.model, args.every_call)
    rooms = len({r for r, _ in stays})
    if args.list:
        for r, n in stays:
            print(f"{n:4d}  {r}")
    print(f"stays {len(stays)} rooms {rooms} returns {len(stays) - rooms}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
