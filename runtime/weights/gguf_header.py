"""The bounded GGUF header scan, kept where runtime's readers import it from: the scan and
its limits live in :mod:`models.safety.gguf_scan`, with every other rule on what a model
file may cost (:mod:`models.safety`). Stdlib only."""
from models.safety.gguf_scan import (  # noqa: F401
    ARRAY,
    CHUNK,
    MAX_ARRAY_DEPTH,
    MAX_ARRAY_ITEMS,
    MAX_KEYS,
    MAX_METADATA_BYTES,
    MAX_NAME_BYTES,
    MAX_OTHER_ARRAY_ITEMS,
    MAX_OTHER_ITEMS,
    MAX_READER_BYTES,
    MAX_STRING_BYTES,
    MAX_TENSORS,
    MAX_TOTAL_ITEMS,
    MAX_VOCAB,
    SCALAR_BYTES,
    STRING,
    GGUFHeaderError,
    HeaderStats,
    _Reader,
    scan_header,
)
