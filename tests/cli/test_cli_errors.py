"""Errors a user can cause on the command line: exit 2, one "attnchat: error:" line, no traceback.

The model cases run the installed entry point (``.venv/bin/attnchat``) as a subprocess,
a few at a time (each process spends seconds importing torch); the argument cases run the
same ``main`` in-process (tests/conftest.py ``attnchat_cli``). Bad arguments are paired with a model path that does not exist: if an argument were
checked only after loading, the error would be about the model, not the argument,
so the message proves the argument is checked first (before the slow load).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tests.hang import HANG_S

ROOT = Path(__file__).resolve().parents[2]
ENTRY = Path(sys.executable).parent / "attnchat"
if not ENTRY.exists():  # the venv's entry point, whichever Python runs the tests
    ENTRY = ROOT / ".venv" / "bin" / "attnchat"

MISSING = "missing.gguf"  # never created

#: name -> (arguments after ``chat --prompt hi``, words the error line must contain).
#: ``{d}`` is the case folder.
MODEL_CASES = {
    "missing-model": (["--model", "{d}/nowhere.gguf"], ["nowhere.gguf", "does not exist"]),
    "pickled-model": (["--model", "{d}/model.bin"], ["model.bin", "pickle"]),
    "non-gguf-model": (["--model", "{d}/readme.gguf"], ["readme.gguf", "not a GGUF"]),
}
ARGUMENT_CASES = {
    "temperature": (["--temperature", "-1"], ["temperature"]),
    "context": (["--context", "0"], ["context"]),
    "cache-dtype": (["--cache-dtype", "int3"], ["int3", "float32"]),
    "dtype": (["--dtype", "int3"], ["weight dtype", "int3"]),
    "max-new-tokens": (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    "overflow": (["--overflow", "sideways"], ["--overflow", "sideways"]),
    "unknown-flag": (["--bogus-flag"], ["unrecognized", "--bogus-flag"]),
}
if not torch.cuda.is_available():
    ARGUMENT_CASES["device-cuda"] = (["--device", "cuda"], ["cuda", "not available"])


class _Payload:
    """Unpickling this creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    (d / "model.bin").write_bytes(pickle.dumps(_Payload(d / "UNPICKLED")))
    (d / "readme.gguf").write_text("not a model\n" * 10)
    return d


def _run(d: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["ATTNCHAT_CACHE_DIR"] = str(d / "cache")
    env["ATTNCHAT_MODELS_DIR"] = str(d / "models")  # never the user's models, never a fetch
    env["HF_HUB_OFFLINE"] = "1"
    argv = [str(ENTRY), "chat", "--prompt", "hi", *(a.format(d=d) for a in args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=HANG_S, cwd=d, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def results(case_dir) -> dict[str, subprocess.CompletedProcess]:
    jobs = {name: args for name, (args, _) in MODEL_CASES.items()}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(_run, case_dir, args) for name, args in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def _assert_user_error(result: subprocess.CompletedProcess, words: list[str]) -> str:
    err = result.stderr
    assert result.returncode == 2, f"exit {result.returncode}; stderr: {err!r}"
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, f"not exactly one line: {err!r}"
    assert err.startswith("attnchat: error: "), err
    for w in words:
        assert w.lower() in err.lower(), f"{w!r} not in {err!r}"
    assert result.stdout == "", result.stdout
    return err


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_bad_model_source(results, case_dir, name):
    _assert_user_error(results[name], MODEL_CASES[name][1])
    assert not (case_dir / "UNPICKLED").exists(), "the pickled checkpoint was unpickled"


@pytest.mark.parametrize("name", list(ARGUMENT_CASES))
def test_bad_argument_fails_before_loading(attnchat_cli, case_dir, monkeypatch, name):
    monkeypatch.setenv("ATTNCHAT_CACHE_DIR", str(case_dir / "cache"))
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(case_dir / "models"))  # never the user's models, never a fetch
    monkeypatch.chdir(case_dir)
    args = ARGUMENT_CASES[name][0] + ["--model", str(case_dir / MISSING)]
    status, out, err = attnchat_cli("chat", "--prompt", "hi", *args)
    err = _assert_user_error(subprocess.CompletedProcess(args, status, out, err), ARGUMENT_CASES[name][1])
    assert MISSING not in err and "does not exist" not in err, "the model was looked at first"


def test_a_good_argument_reaches_the_model(results, case_dir):
    """The control for the cases above: valid arguments get as far as the (missing) model."""
    r = _run(case_dir, ["--temperature", "0.7", "--context", "64", "--cache-dtype", "bfloat16",
                        "--device", "cpu", "--model", f"{{d}}/{MISSING}"])
    err = _assert_user_error(r, [MISSING, "does not exist"])
    assert "temperature" not in err


def test_help_lists_every_weight_dtype():
    """``--dtype`` takes int8 (8-bit weights); both commands' help says so,
    and offers --reproducible."""
    import argparse

    from attnchat.cli import chat
    from attnchat.server import command
    from runtime.dtypes import WEIGHT_DTYPES

    for add in (chat.add_parser, command.add_parser):
        sub = argparse.ArgumentParser().add_subparsers()
        add(sub)
        parser = next(iter(sub.choices.values()))
        helps = {s: a.help for a in parser._actions for s in a.option_strings}
        assert all(name in helps["--dtype"] for name in WEIGHT_DTYPES), (add, helps["--dtype"])
        assert "--reproducible" in helps
