"""Model folders whose JSON names code: ``auto_map`` (transformers' pointer to Python shipped
with a model) under any spelling and at any depth, and any string naming a ``*.py`` file of
the folder. Stdlib only; never imports or runs what it checks.

Every ``*.json`` of the folder (subfolders too; links to folders are not followed) is read
as JSON is parsed: each string literal is found in order and decoded, so ``"auto\\u005fmap"``
is the key ``auto_map`` as transformers reads it (a byte search for ``"auto_map"`` missed
it). The strings are matched over the file's bytes, one at a time, so checking a
file costs its size in memory (not the ~12x a parse into Python objects can cost) and
about a second for a 33 MB tokenizer.json on the Intel Xeon.
"""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

#: JSON files bigger than this are refused unread: the largest a model carries, a
#: tokenizer.json of a 262,144-token vocabulary (Gemma 3), is ~33 MB.
MAX_JSON_BYTES = 64 << 20
#: A chat template file (``chat_template.jinja``): real ones are tens of KB; the same
#: limit as a GGUF's strings and the sandbox's templates.
MAX_TEMPLATE_FILE_BYTES = 1 << 20
#: The key through which transformers imports a model's own Python (``trust_remote_code``).
CUSTOM_CODE_KEY = "auto_map"
#: Longest string value checked against the folder's Python files (module paths are short).
_MAX_REFERENCE_CHARS = 512

#: A run of anything but quotes, then one string literal, then ``:`` when it is a key.
#: Matched at the end of the previous match only (``match(data, pos)``), so a string is
#: never read from inside another; the body is the unrolled ``(?:[^"\\]|\\.)*`` (no
#: backtracking, and fast in ``re``).
_NEXT_STRING = re.compile(rb'[^"]*+"([^"\\]*+(?:\\.[^"\\]*+)*+)"(\s*+:)?+', re.S)
_TRAILER = re.compile(rb'[^"]*+\Z')


def spelled(text: str) -> bytes:
    """A regular expression (bytes) matching ``text`` as a JSON string may spell it: each
    character as itself or as a ``\\uXXXX`` escape (the only escapes that spell letters,
    digits and ``_``)."""
    return b"".join(b"(?:%s|\\\\u(?i:%04x))" % (re.escape(ch.encode()), ord(ch)) for ch in text)


#: The key ``auto_map`` in any spelling: 8 units, each the letter or its ``\\u`` escape.
#: Searched anywhere in the bytes: in valid JSON a key's quotes are never inside another
#: string, so every key is found; a match inside a string value (it would need escaped
#: quotes around it, ``\\"auto_map\\":``) cannot happen.
_KEY = re.compile(b'"' + spelled(CUSTOM_CODE_KEY) + rb'"\s*+:')


class CustomCodeError(ValueError):
    """A folder names code (one line: the file, and what it named), or a JSON file could not
    be checked (too big, not JSON)."""


def python_modules(folder: Path) -> set[str]:
    """Dotted module paths of the ``*.py`` files under ``folder`` (``sub/x.py`` -> ``sub.x``)."""
    found = set()
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in files:
            if name.lower().endswith(".py"):
                rel = (Path(root) / name).relative_to(folder).with_suffix("")
                found.add(".".join(rel.parts))
    return found


def _names_module(text: str, modules: set[str]) -> bool:
    """True when ``text`` names one of ``modules``: ``x.py``, ``x.Class``, ``repo--x.Class``."""
    if not text or len(text) > _MAX_REFERENCE_CHARS:
        return False
    ref = text.split("--")[-1].strip().replace("/", ".").replace("\\", ".")
    if ref.lower().endswith(".py"):
        return ref[:-3] in modules or ref[:-3].rsplit(".", 1)[-1] in modules
    return ref in modules or ref.rsplit(".", 1)[0] in modules


def _decode(raw: bytes) -> str:
    if b"\\" not in raw:
        return raw.decode("utf-8", "surrogateescape")
    return json.loads(b'"' + raw + b'"', strict=False)


def check_json(file: Path, modules: set[str] = frozenset()) -> str | None:
    """What ``file`` names that runs code (``"auto_map"``, or a string naming one of
    ``modules``), or None.

    The key is found by one search over the bytes (:data:`_KEY`); strings naming a module
    only when ``modules`` is not empty (a folder with Python files) and a module's name
    appears in the file, by walking every string literal in order.

    Raises:
        CustomCodeError: the file is over :data:`MAX_JSON_BYTES`, or not JSON text (an
            unterminated string, a bad escape).
        OSError: it cannot be read.
    """
    # O_NONBLOCK: opening a FIFO would wait for a writer (no effect on a regular file)
    with os.fdopen(os.open(file, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CustomCodeError(f"{file.name} is not a regular file")
        if st.st_size > MAX_JSON_BYTES:
            raise CustomCodeError(f"{file.name} is {st.st_size:,} bytes, bigger than any model's JSON "
                                  f"(the limit is {MAX_JSON_BYTES >> 20} MiB)")
        data = f.read(MAX_JSON_BYTES + 1)  # never more, should the file grow meanwhile
    if len(data) > MAX_JSON_BYTES:
        raise CustomCodeError(f"{file.name} grew past {MAX_JSON_BYTES >> 20} MiB while it was read")
    if _KEY.search(data):
        return f"'{CUSTOM_CODE_KEY}'"
    stems = {m.rsplit(".", 1)[-1] for m in modules}
    if not any(re.search(spelled(stem), data) for stem in stems):
        return None  # no string can name a module whose name appears nowhere
    pos, end = 0, len(data)
    while pos < end:
        m = _NEXT_STRING.match(data, pos)
        if m is None:
            if _TRAILER.match(data, pos):
                break
            at = data.find(b'"', pos)
            raise CustomCodeError(f"{file.name} is not JSON (a string at byte {at:,} never ends)")
        pos = m.end()
        raw = m.group(1)
        if m.group(2) is None and len(raw) <= 4 * _MAX_REFERENCE_CHARS:
            text = _decoded(raw, file)
            if _names_module(text, modules):
                return f"{text!r}, a Python file of the folder"
    return None


def _decoded(raw: bytes, file: Path) -> str:
    try:
        return _decode(raw)
    except ValueError:
        raise CustomCodeError(f"{file.name} is not JSON (a bad escape in {raw[:40]!r})") from None


def find_custom_code(folder: Path) -> tuple[Path, str] | None:
    """The first ``*.json`` under ``folder`` naming code, and what it names (see
    :func:`check_json`), or None. Files are visited in sorted order.

    Raises:
        CustomCodeError: a JSON file that cannot be checked (its name is in the message).
    """
    check_entries(folder)
    modules = python_modules(folder)
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            if not name.lower().endswith(".json"):
                continue
            file = Path(root) / name
            try:
                found = check_json(file, modules)
            except OSError:
                continue  # unreadable: transformers cannot read it either
            except CustomCodeError as e:
                raise CustomCodeError(f"{file.relative_to(folder)}: {e}") from None
            if found:
                return file.relative_to(folder), found
    return None


def check_entries(folder: Path) -> None:
    """Every entry under ``folder`` is a regular file or a folder once links are followed,
    and its chat templates (``*.jinja``) are at most :data:`MAX_TEMPLATE_FILE_BYTES`.

    A link to ``/dev/zero`` as ``generation_config.json`` takes a reader to 10.9 GB, and a
    FIFO keeps it waiting forever; transformers reads a
    ``chat_template.jinja`` whole, whatever its size.

    Raises:
        CustomCodeError: the first entry that is a device, a FIFO or a socket, or a template
            file past the limit (its path in the folder is in the message).
    """
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            file = Path(root) / name
            try:
                st = file.stat()
            except OSError:
                continue  # a broken link: nothing can read it
            where = file.relative_to(folder)
            if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
                raise CustomCodeError(f"{where} is not a regular file (a device, a pipe or a socket)")
            if name.lower().endswith(".jinja") and st.st_size > MAX_TEMPLATE_FILE_BYTES:
                raise CustomCodeError(f"{where} is {st.st_size:,} bytes, bigger than any chat template "
                                      f"(the limit is {MAX_TEMPLATE_FILE_BYTES >> 20} MiB)")
