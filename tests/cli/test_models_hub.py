"""``attnchat models search|files|fetch`` against the stand-in Hub: tables, JSON, fits from the
planner, progress, resume after Ctrl-C, one-line errors with exit status 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import models
from attnchat import cli
from runtime.kernels import ggml_ops
from tests.hub_stand_in import COMMIT, gguf_bytes, hub  # noqa: F401 - hub is a fixture
from tests.hang import HANG_S

ROOT = Path(__file__).resolve().parents[2]
REPO = "owner/Tiny-Instruct-GGUF"
SHAPE = dict(layers=3, heads=4, kv_heads=2, embd=128, context=2048)
KV_AT_2048 = 2 * 3 * 2 * 32 * 4 * 2048   # float32 K and V, 3 layers x 2 KV heads x 32, 2,048 tokens


def tiny(hub, **kw):
    return hub.add_repo(REPO, {
        "Tiny-Instruct-Q4_K_M.gguf": gguf_bytes(payload=300_000, seed=1, **SHAPE),
        "Tiny-Instruct-Q8_0.gguf": gguf_bytes(payload=500_000, seed=2, **SHAPE),
        "Tiny-Instruct-F16-00001-of-00002.gguf": gguf_bytes(payload=600_000, seed=3, **SHAPE),
        "Tiny-Instruct-F16-00002-of-00002.gguf": b"z" * 600_000,
    }, downloads=1234, **kw)


def run(capsys, *argv):
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_search_table_and_json(hub, capsys):
    tiny(hub)
    hub.add_repo("b/tiny-mamba-GGUF", {"m-Q4_K_M.gguf": gguf_bytes("mamba")}, downloads=99999, architecture="mamba",
                 gated="auto", license="other-license")
    status, out, err = run(capsys, "models", "search", "tiny")
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["REF", "DOWNLOADS", "LICENSE", "ARCHITECTURE", "GATED"] and len(lines) == 3
    assert lines[1].split() == ["hf.co/b/tiny-mamba-GGUF", "99,999", "other-license", "mamba", "(not", "supported)", "yes"]
    assert lines[2].split() == [f"hf.co/{REPO}", "1,234", "apache-2.0", "llama", "-"]
    status, out, _ = run(capsys, "models", "search", "tiny", "--json", "--limit", "1")
    data = json.loads(out)
    assert status == 0 and [d["ref"] for d in data] == ["hf.co/b/tiny-mamba-GGUF"]
    assert data[0]["downloads"] == 99999 and data[0]["supported"] is False and data[0]["gated"] == "auto"


def test_files_with_fits_from_the_planner(hub, capsys, monkeypatch):
    import psutil

    repo = tiny(hub)
    free = 4_400_000
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": free})())
    status, out, err = run(capsys, "models", "files", f"hf.co/{REPO}:Q8_0")
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"hf.co/{REPO}  license apache-2.0  architecture llama"
    # float16: the cache the runtime gives a quantized GGUF run from its blocks on the CPU
    assert lines[1] == "fit: the file + the KV cache at 2,048 tokens (float16) against 4.2 MiB free on cpu"
    assert lines[2].split() == ["FILE", "QUANT", "SIZE", "RUNS", "FIT", "NEEDS", "HERE"]
    q4, q8 = (len(repo.files[f"Tiny-Instruct-{q}.gguf"]) for q in ("Q4_K_M", "Q8_0"))
    kernel = "ggml" if ggml_ops.available() else "torch int4pack"
    assert lines[3].split() == ["Tiny-Instruct-Q4_K_M.gguf", "Q4_K_M", "297.3", "KiB", *kernel.split(), "fits", "1.8",
                                "MiB", "-"]
    if ggml_ops.available():
        assert lines[4].split() == ["*", "Tiny-Instruct-Q8_0.gguf", "Q8_0", "492.6", "KiB", "ggml", "fits", "2.0", "MiB",
                                    "-"]
    assert lines[5].split()[:2] == ["Tiny-Instruct-F16-00001-of-00002.gguf", "F16"]
    assert "split in 2 files (not supported)" in lines[5]
    status, out, _ = run(capsys, "models", "files", f"hf.co/{REPO}", "--json", "--context", "1024")
    report = json.loads(out)
    assert status == 0 and report["context"] == 1024 and report["commit"] == COMMIT
    assert report["shape"] == {"architecture": "llama", "layers": 3, "heads": 4, "kv_heads": 2, "head_dim": 32,
                               "context_length": 2048, "windows": [None, None, None]}
    f = report["files"][1]
    assert (f["name"], f["size_bytes"], f["installed"], f["split"]) == ("Tiny-Instruct-Q8_0.gguf", q8, False, False)
    kv = KV_AT_2048 // 4   # 1,024 tokens in float16
    assert f["fit"] == {"verdict": "tight" if q8 + kv > 0.8 * free else "fits", "weights_bytes": q8,
                        "kv_bytes": kv, "total_bytes": q8 + kv, "free_bytes": free,
                        "context": 1024, "device": "cpu", "cache_dtype": "float16",
                        "kv_bytes_per_token": KV_AT_2048 // 4 // 1024}
    assert report["files"][2]["fit"] is None and report["files"][2]["parts"] == 2
    assert f["runs"]["block_type"] == "Q8_0" and f["runs"]["bits_per_weight"] == 8.5


def test_files_mark_what_runs_here(hub, capsys, monkeypatch):
    """Without ggml: IQ4_XS runs from float16 copies (their bytes in the fit), a 4-bit K mix
    through torch's int4pack, Q1_0 (only ggml decodes it) and an unknown tag will not run."""
    import psutil

    hub.add_repo(REPO, {f"Tiny-Instruct-{q}.gguf": gguf_bytes(payload=100_000 * (i + 1), seed=i, **SHAPE)
                        for i, q in enumerate(("Q1_0", "IQ4_XS", "Q4_K_M", "Q9_X"))})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 1 << 30})())
    monkeypatch.setitem(ggml_ops._STATE, "why", "turned off for a test")
    monkeypatch.delitem(ggml_ops._STATE, "ggml", raising=False)
    status, out, err = run(capsys, "models", "files", f"hf.co/{REPO}", "--json")
    files = {f["quant"]: f for f in json.loads(out)["files"]}
    iq4 = files["IQ4_XS"]
    weights = int(iq4["size_bytes"] * 8 / 4.25)
    assert iq4["runs"] == {"block_type": "IQ4_XS", "runs": "widened", "kernel": "float16 copy", "bits_per_weight": 4.25,
                           "why": "ggml does not load here (turned off for a test)", "extra_bytes": weights * 2}
    assert iq4["fit"]["weights_bytes"] == iq4["size_bytes"] + weights * 2
    assert files["Q4_K_M"]["runs"]["runs"] == "blocks" and files["Q4_K_M"]["runs"]["kernel"] == "torch int4pack"
    assert files["Q4_K_M"]["fit"]["weights_bytes"] == files["Q4_K_M"]["size_bytes"]
    assert files["Q1_0"]["runs"]["runs"] == "no" and files["Q1_0"]["fit"] is None
    assert files["Q9_X"]["runs"] == {"block_type": "", "runs": "no", "kernel": "", "bits_per_weight": 0.0,
                                     "why": "Q9_X names no block type attnchat knows", "extra_bytes": 0}
    status, out, err = run(capsys, "models", "files", f"hf.co/{REPO}")
    rows = {line.split()[1]: line for line in out.splitlines()[3:]}
    assert weights * 2 == 769_632 and "widened (+751.6 KiB)" in rows["IQ4_XS"]
    assert "will not run" in rows["Q1_0"] and "only ggml decodes Q1_0 and ggml does not load here" in rows["Q1_0"]


def test_fetch_prints_the_path_and_a_second_fetch_needs_no_network(hub, capsys):
    repo = tiny(hub)
    status, out, err = run(capsys, "models", "fetch", f"hf.co/{REPO}:q4_k_m")
    path = Path(out.strip())
    assert status == 0 and err == ""
    assert path == models.models_dir() / "hf.co" / REPO / "Tiny-Instruct-Q4_K_M.gguf"
    assert path.read_bytes() == repo.files["Tiny-Instruct-Q4_K_M.gguf"]
    hub.stop()
    status, out, _ = run(capsys, "models", "fetch", f"hf.co/{REPO}:Q4_K_M")
    assert status == 0 and Path(out.strip()) == path
    status, out, _ = run(capsys, "models", "list", "--json")
    assert [r["id"] for r in json.loads(out) if r["source"] == "hub"] == [f"hf.co/{REPO}/Tiny-Instruct-Q4_K_M.gguf"]


@pytest.mark.parametrize("argv, kind_words", [
    (["models", "fetch", "hf.co/owner/Nope-GGUF:Q4_K_M"], "no such model repo on the Hub"),
    (["models", "fetch", f"hf.co/{REPO}:Q3_K_S"], f"hf.co/{REPO} has no Q3_K_S file; it has F16, Q4_K_M, Q8_0"),
    (["models", "fetch", f"hf.co/{REPO}:F16"], "is split into 2 files; attnchat loads single-file GGUFs only"),
    (["models", "files", "hf.co/owner"], "names no repo"),
    (["models", "fetch", "no-such-id"], "or a Hugging Face model as hf.co/OWNER/REPO:QUANT"),
])
def test_errors_are_one_line_and_exit_2(hub, capsys, argv, kind_words):
    tiny(hub)
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    assert err.startswith("attnchat: error: ") and err.count("\n") == 1 and kind_words in err, err


def test_importing_the_command_line_leaves_the_hub_switch_to_it():
    """Importing the command line (every command's module, the benchmark's worker among them)
    changes no hub variable: otherwise the entry point's switch reads a HF_HUB_OFFLINE a module
    set and takes it for the user's, and every Hub command says the Hub is switched off."""
    code = ("import json, os; before = dict(os.environ); import attnchat.cli.entry; "
            "print(json.dumps({k: os.environ.get(k) for k in set(os.environ) ^ set(before)}))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "ATTNCHAT_HUB_OFFLINE_BY_APP")}
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd="/", env=env, capture_output=True, text=True,
                         timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    changed = json.loads(out.stdout)
    assert not {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"} & set(changed), changed


def test_fetch_in_a_real_process_resumes_after_ctrl_c(hub, tmp_path):
    """The installed command, its own process: the libraries are switched offline by the command
    line itself, the Hub still answers; SIGINT mid-download exits 130 and keeps the part; the
    same command resumes with a Range request."""
    import signal
    import time

    name = "Tiny-Instruct-Q6_K.gguf"
    repo = hub.add_repo(REPO, {name: gguf_bytes(payload=3_000_000, seed=7, **SHAPE)})
    # 64 KiB every 100 ms: the 3 MB in ~5 s, handed over in 1 MiB chunks; the 3 s after the first
    # chunk leave the signal time to land on a loaded machine (at 20 ms the whole file arrived first)
    hub.throttle_s = 0.1
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "ATTNCHAT_MODELS_DIR": os.environ["ATTNCHAT_MODELS_DIR"],
           "HF_TOKEN_PATH": str(tmp_path / "none"), "XDG_STATE_HOME": str(tmp_path / "state")}
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "ATTNCHAT_HUB_OFFLINE_BY_APP", "HF_TOKEN"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "attnchat", "models", "fetch", f"hf.co/{REPO}:Q6_K"]
    # SIGINT as a terminal's Ctrl-C sends it: a suite started in the background (`make test &`, a CI
    # runner without job control) runs with SIGINT ignored, every child inherits that, and the
    # command then never hears it (seen: four SIGINTs, the download finished with exit 0)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while models.hub.partial_bytes(repo.sha(name)) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)   # until the first 1 MiB chunk is written (the rest takes ~3 s more to arrive)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == ("attnchat: error: interrupted (the bytes downloaded so far are kept: "
                                            "the same command resumes)")
    kept = models.hub.partial_bytes(repo.sha(name))
    assert 0 < kept < len(repo.files[name]) and kept % (1 << 20) == 0
    hub.throttle_s = 0
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).read_bytes() == repo.files[name]
    assert hub.hits("cdn", "GET")[-1].range == f"bytes={kept}-"
    # Nothing but what was asked: no telemetry request (huggingface_hub's agent-harness list).
    assert {r.path for r in hub.hits("hub")} == {f"/api/models/{REPO}", f"/{REPO}/resolve/main/{name}"}


class TTY:
    """A stderr that says it is a terminal."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return True


def test_model_source_fetches_a_reference_first_and_passes_paths_through(hub, tmp_path):
    from attnchat.fetching import model_source

    repo = tiny(hub)
    err = TTY()
    path = model_source(f"hf.co/{REPO}:Q8_0", err)
    assert Path(path).read_bytes() == repo.files["Tiny-Instruct-Q8_0.gguf"]
    assert len(repo.files["Tiny-Instruct-Q8_0.gguf"]) == 504_434
    assert err.text.rstrip("\n").endswith(f"fetching hf.co/{REPO}:Q8_0: 100% (492.6 KiB of 492.6 KiB)")
    n = len(hub.requests)
    assert model_source(f"hf.co/{REPO}:Q8_0", TTY()) == path and len(hub.requests) == n   # already here
    assert model_source(None) is None
    own = tmp_path / "own.gguf"
    own.write_bytes(b"GGUF")
    assert model_source(str(own)) == str(own)
    assert model_source(str(tmp_path / "missing.gguf")) == str(tmp_path / "missing.gguf")  # the loader says so
    with pytest.raises(models.HubError, match="has no Q2_K file"):
        model_source(f"hf.co/{REPO}:Q2_K")


@pytest.mark.parametrize("command", ["chat", "heads"])
def test_model_option_fetches_a_reference_before_loading(hub, monkeypatch, command):
    """chat (and heads) hand the loader the downloaded file's path; serve and bench call the same
    model_source (attnchat/server/command.py, attnchat/bench/command.py)."""
    import runtime
    from attnchat.cli import chat as chat_cmd
    from attnchat.cli import heads as heads_cmd

    repo = tiny(hub)
    seen = []

    class Stop(Exception):
        pass

    def load_model(source, **kw):
        seen.append(source)
        raise Stop

    monkeypatch.setattr(runtime, "load_model", load_model)
    args = cli.build_parser().parse_args([command, "--model", f"hf.co/{REPO}", "--device", "cpu"])
    with pytest.raises(Stop):
        chat_cmd._load(args) if command == "chat" else heads_cmd.run(args)
    assert Path(seen[0]).read_bytes() == repo.files["Tiny-Instruct-Q4_K_M.gguf"]


@pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python not installed")
def test_chat_with_an_iq4_xs_reference_fetches_it_and_answers_through_ggml(hub, tmp_path, capsys, monkeypatch):
    """``hf.co/OWNER/REPO:IQ4_XS``: the file that tag names, fetched, loaded from its blocks (ggml's
    kernels), a reply."""
    from tests.runtime.tiny_gguf import make_tiny_gguf, tiny_tokenizer_metadata

    monkeypatch.setenv("ATTNCHAT_KERNELS", "default")
    tok = tiny_tokenizer_metadata()
    blobs = {f"Tiny-Instruct-{t}.gguf": make_tiny_gguf(tmp_path, f"{t}.gguf", matrix_type="Q4_K" if t == "Q4_K_M" else t,
                                                       embed_type="Q8_0", tokenizer=tok).read_bytes()
             for t in ("IQ4_XS", "Q4_K_M")}
    hub.add_repo(REPO, blobs)
    status, out, err = run(capsys, "chat", "--model", f"hf.co/{REPO}:IQ4_XS", "--device", "cpu", "--prompt", "hi",
                           "--max-new-tokens", "4", "--temperature", "0", "--json")
    assert status == 0, err
    reply = json.loads(out.splitlines()[-1])
    assert reply["completion_tokens"] >= 1 and reply["finish_reason"] in ("stop", "length")
    assert (reply["model"], reply["dtype"]) == ("Tiny-Instruct-IQ4_XS", "IQ4_XS")  # its own blocks, not widened
