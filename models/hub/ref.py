"""References to models on the Hugging Face Hub, and the quant tags in GGUF file names.

Stdlib only (no huggingface_hub, no torch): the command line parses references cheaply. The forms people type (Ollama's, and the
addresses a browser shows):

- ``hf.co/OWNER/REPO``                 the catalog's preferred file for that repo, else Q4_K_M
- ``hf.co/OWNER/REPO:Q4_K_M``          the file whose name carries that quant tag (any case)
- ``hf.co/OWNER/REPO/FILE.gguf``       that file (it may sit in a sub-folder of the repo)
- ``https://huggingface.co/OWNER/REPO/blob/REV/FILE.gguf`` (or ``/resolve/REV/``) at revision REV

``huggingface.co/`` works wherever ``hf.co/`` does, with or without ``https://``.
A split GGUF (``NAME-00001-of-00003.gguf``) is one model in several files: :func:`group_files`
keeps its parts together.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from models.errors import HubError

__all__ = [
    "HubRef", "RefError", "GGUFFile", "HubFile", "DEFAULT_QUANT", "choose", "group_files", "is_hub_ref",
    "parse_ref", "quant_tag", "split_part", "tag_block_type",
]

DEFAULT_QUANT = "Q4_K_M"
"""The quant a reference without a tag gets (Ollama's default too), unless the catalog prefers one."""

_PREFIX = re.compile(r"^(?:https?://)?(?:www\.)?(?:hf\.co|huggingface\.co)/", re.IGNORECASE)
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?$")
"""An owner or repo name as the Hub allows them (letters, digits, ``-``, ``_``, ``.``; no ``..``)."""
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d(?:_[A-Za-z0-9]+)*|BF16|F16|F32|FP16|FP32|TQ\d_\d|MXFP4(?:_MOE)?))"
    r"(?![A-Za-z0-9])", re.IGNORECASE)
"""Quant tags as llama.cpp's quantize names them (Q4_K_M, IQ4_XS, Q8_0, BF16...), plus unsloth's ``UD-`` ones."""


class RefError(HubError):
    """A reference is not one attnchat understands, or names nothing in its repo; ``str()``
    is one line saying what to type."""

    def __init__(self, message: str):
        super().__init__(message, "ref")


@dataclass(frozen=True)
class HubRef:
    """A parsed reference.

    Attributes:
        repo_id: ``OWNER/REPO``.
        filename: a file's path inside the repo ("" when chosen by tag or default).
        quant: the quant tag asked for, upper case ("" when none).
        revision: a branch, tag or commit ("main" unless the address named one).
    """

    repo_id: str
    filename: str = ""
    quant: str = ""
    revision: str = "main"

    def __str__(self) -> str:
        if self.filename:
            return f"hf.co/{self.repo_id}/{self.filename}"
        return f"hf.co/{self.repo_id}" + (f":{self.quant}" if self.quant else "")


def is_hub_ref(text: str) -> bool:
    """Whether ``text`` starts like a Hub reference (``hf.co/`` or ``huggingface.co/``)."""
    return bool(_PREFIX.match(text.strip()))


def _check_name(part: str, what: str, text: str) -> str:
    if not _NAME.match(part) or ".." in part:
        raise RefError(f"{text!r} is not a Hub reference: {what} {part!r} is not a valid name; "
                       "use hf.co/OWNER/REPO:QUANT or hf.co/OWNER/REPO/FILE.gguf")
    return part


def _check_path(path: str, text: str) -> str:
    parts = path.split("/")
    if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise RefError(f"{text!r}: {path!r} is not a file path inside a repo")
    if not path.lower().endswith(".gguf"):
        raise RefError(f"{text!r} names {parts[-1]!r}, which is not a .gguf file; attnchat fetches GGUF "
                       "files from the Hub (hf.co/OWNER/REPO/FILE.gguf or hf.co/OWNER/REPO:QUANT)")
    return path


def parse_ref(text: str) -> HubRef:
    """Parse a Hub reference (see the module docstring for the forms).

    Raises:
        RefError: not a Hub reference, a bad owner/repo name, a file that is not ``.gguf``,
            or an empty quant tag.
    """
    raw = text.strip()
    m = _PREFIX.match(raw)
    if not m:
        raise RefError(f"{text!r} is not a Hub reference; use hf.co/OWNER/REPO:QUANT or hf.co/OWNER/REPO/FILE.gguf")
    rest = raw[m.end():].split("?", 1)[0].split("#", 1)[0].rstrip("/")
    parts = rest.split("/")
    if len(parts) < 2:
        raise RefError(f"{text!r} names no repo; use hf.co/OWNER/REPO:QUANT or hf.co/OWNER/REPO/FILE.gguf")
    owner, repo = parts[0], parts[1]
    quant = ""
    if len(parts) == 2 and ":" in repo:
        repo, quant = repo.split(":", 1)
        if not quant.strip():
            raise RefError(f"{text!r} has an empty quant tag after ':'; e.g. hf.co/{owner}/{repo}:{DEFAULT_QUANT}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", quant):
            raise RefError(f"{text!r}: {quant!r} is not a quant tag (e.g. {DEFAULT_QUANT}, Q8_0, IQ4_XS)")
    repo_id = f"{_check_name(owner, 'owner', text)}/{_check_name(repo, 'repo', text)}"
    revision, path_parts = "main", parts[2:]
    if len(path_parts) >= 2 and path_parts[0] in ("blob", "resolve"):
        revision, path_parts = path_parts[1], path_parts[2:]
        if not path_parts:
            raise RefError(f"{text!r} names a revision but no file")
    elif path_parts and path_parts[0] == "tree":
        raise RefError(f"{text!r} is a folder of the repo; name a file (hf.co/{repo_id}/FILE.gguf) or a quant "
                       f"(hf.co/{repo_id}:{DEFAULT_QUANT})")
    filename = _check_path("/".join(path_parts), text) if path_parts else ""
    return HubRef(repo_id=repo_id, filename=filename, quant=quant.upper(), revision=revision)


def quant_tag(filename: str) -> str:
    """The quant tag in a GGUF file name, upper case (``"Q4_K_M"``), or "" when none is there.

    The last tag-like word of the name's last part counts (``Qwen2.5-1.5B-Instruct-Q4_K_M.gguf``:
    ``Q4_K_M``; ``Llama-3.2-1B-Instruct-IQ4_XS.gguf``: ``IQ4_XS``); a split suffix is ignored.
    """
    name = filename.rsplit("/", 1)[-1]
    name = _SPLIT.sub("", name)
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    found = _QUANT.findall(name)
    return found[-1].upper() if found else ""


#: llama.cpp's mixes whose main block type is not the tag's stem (llama-quant.cpp's default
#: type per ``LLAMA_FTYPE``): IQ2_M and IQ3_XS/IQ3_M are mostly IQ2_S / IQ3_S blocks.
_TAG_TYPES = {"IQ2_M": "IQ2_S", "IQ3_XS": "IQ3_S", "IQ3_M": "IQ3_S", "MXFP4_MOE": "MXFP4", "FP16": "F16",
              "FP32": "F32", "Q2_K_S": "Q2_K"}
#: ggml block type names (gguf's ``GGMLQuantizationType``) a tag may name whole.
_BLOCK_NAMES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M", "TQ1_0",
                "TQ2_0", "MXFP4", "NVFP4", "Q1_0")


def tag_block_type(tag: str) -> str:
    """The block type most of a file's matrices are in, from its quant tag: ``"Q4_K_M"`` -> ``"Q4_K"``,
    ``"UD-Q4_K_XL"`` -> ``"Q4_K"``, ``"IQ4_XS"`` -> ``"IQ4_XS"``, ``"IQ3_M"`` -> ``"IQ3_S"``; "" for
    a tag that names no block type (a mix's other matrices are in the types llama.cpp gives
    them: Q6_K, Q8_0, Q5_K ... for a K mix)."""
    t = tag.upper().removeprefix("UD-")
    if t in _TAG_TYPES:
        return _TAG_TYPES[t]
    if t in _BLOCK_NAMES:
        return t
    stem = re.sub(r"_(?:XS|S|M|L|XL|XXL)$", "", t)
    return stem if stem in _BLOCK_NAMES else ""


def split_part(filename: str) -> tuple[int, int] | None:
    """``(index, count)`` for a part of a split GGUF (``...-00002-of-00003.gguf``: (2, 3)), else None."""
    m = _SPLIT.search(filename)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class HubFile:
    """One file of a repo as the Hub lists it.

    Attributes:
        path: its path inside the repo.
        size_bytes: its size in bytes.
        sha256: the LFS sha256 the Hub holds for it ("" for a file not in LFS).
    """

    path: str
    size_bytes: int
    sha256: str = ""


@dataclass(frozen=True)
class GGUFFile:
    """One GGUF model in a repo: one file, or the parts of a split one in order.

    Attributes:
        name: the file's path in the repo (the first part's, for a split model).
        quant: its quant tag (:func:`quant_tag`), "" when the name has none.
        parts: the files, in order (one unless split).
    """

    name: str
    quant: str
    parts: tuple[HubFile, ...]

    @property
    def size_bytes(self) -> int:
        """All parts' bytes together."""
        return sum(p.size_bytes for p in self.parts)

    @property
    def split(self) -> bool:
        """Whether it comes in several files."""
        return len(self.parts) > 1


def _is_model_file(path: str) -> bool:
    """GGUF files that are language models: not vision projectors (``mmproj-*.gguf``) or imatrix data."""
    base = path.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and not base.startswith("mmproj") and "imatrix" not in base


def group_files(files: list[HubFile]) -> list[GGUFFile]:
    """The repo's GGUF models, split ones grouped into one entry, sorted by size (smallest first).

    A split model whose parts are not all listed is left out (it cannot be fetched whole).
    """
    singles: list[GGUFFile] = []
    groups: dict[str, dict[int, HubFile]] = {}
    counts: dict[str, int] = {}
    for f in files:
        if not _is_model_file(f.path):
            continue
        part = split_part(f.path)
        if part is None:
            singles.append(GGUFFile(f.path, quant_tag(f.path), (f,)))
            continue
        key = _SPLIT.sub("", f.path)
        groups.setdefault(key, {})[part[0]] = f
        counts[key] = part[1]
    for key, parts in groups.items():
        n = counts[key]
        if sorted(parts) == list(range(1, n + 1)):
            ordered = tuple(parts[i] for i in range(1, n + 1))
            singles.append(GGUFFile(ordered[0].path, quant_tag(ordered[0].path), ordered))
    return sorted(singles, key=lambda g: (g.size_bytes, g.name))


def _tag_in_name(tag: str, name: str) -> bool:
    base = _SPLIT.sub("", name.rsplit("/", 1)[-1])
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9]|_[A-Za-z0-9])", base, re.IGNORECASE) is not None


def choose(ggufs: list[GGUFFile], ref: HubRef, preferred: str = "") -> GGUFFile:
    """The GGUF model ``ref`` means among a repo's ``ggufs``.

    ``ref.filename`` names it (a split model by any of its parts); else ``ref.quant`` picks
    the one whose quant tag is that (case-insensitive; a tag inside the name as a fallback,
    e.g. ``:Q4_K_L``); else ``preferred`` (the catalog's file), else :data:`DEFAULT_QUANT`,
    else the repo's only model. A single file wins over a split one with the same tag.

    Raises:
        RefError: nothing matches (the message lists the quants there are), or a tag
            matches several different files (the message lists them).
    """
    where = f"hf.co/{ref.repo_id}"
    if not ggufs:
        raise RefError(f"{where} has no GGUF model files; attnchat fetches GGUF files (search with "
                       "`attnchat models search TEXT`)")
    if ref.filename:
        for g in ggufs:
            if ref.filename == g.name or any(ref.filename == p.path for p in g.parts):
                return g
        raise RefError(f"{where} has no file {ref.filename!r}; its GGUF files: "
                       + ", ".join(g.name for g in ggufs[:12]) + (" ..." if len(ggufs) > 12 else ""))
    if not ref.quant and preferred:
        for g in ggufs:
            if g.name == preferred:
                return g
    tag = ref.quant or DEFAULT_QUANT
    hits = [g for g in ggufs if g.quant == tag] or [g for g in ggufs if _tag_in_name(tag, g.name)]
    if not hits and not ref.quant and len(ggufs) == 1:
        return ggufs[0]
    if not hits:
        tags = sorted({g.quant for g in ggufs if g.quant})
        have = ", ".join(tags) if tags else ", ".join(g.name for g in ggufs[:8])
        raise RefError(f"{where} has no {tag} file; it has {have}: pick one as {where}:TAG "
                       "(`attnchat models files` lists them with sizes)")
    singles = [g for g in hits if not g.split]
    hits = singles or hits
    if len(hits) > 1:
        names = ", ".join(g.name for g in hits[:6])
        raise RefError(f"{where}:{tag} matches {len(hits)} files ({names}); name one as {where}/FILE.gguf")
    return hits[0]
