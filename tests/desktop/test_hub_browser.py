"""File > Models… > Hugging Face Hub against the stand-in Hub (tests/hub_stand_in.py): search,
a repo's quants with fit badges and their numbers, the license before a download, progress,
Cancel and resume, Load; offline shows the models on this computer."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

import models
import runtime
from desktop.model_switcher import HubService, ModelsDialog
from desktop.model_switcher.hub_jobs import entry_block_type
from desktop.sizes import size_text
from runtime.kernels import ggml_ops
from tests.hub_stand_in import COMMIT, gguf_bytes, hub  # noqa: F401 - hub is a fixture

REPO = "owner/Tiny-Instruct-GGUF"
SHAPE = dict(layers=3, heads=4, kv_heads=2, embd=128, context=2048)
#: Its KV cache at 2,048 tokens in float32: 2 x 3 layers x 2 KV heads x 32 x 4 bytes x 2,048.
KV_AT_2048 = 2 * 3 * 2 * 32 * 4 * 2048
#: In float16: the cache the runtime gives a quantized GGUF run from its blocks on the CPU.
KV16_AT_2048 = KV_AT_2048 // 2
FREE = 2_450_000   # bytes "free": the Q4_K_M file fits (77 %), Q8_0 is tight (85 %), F32 does not fit
SHOTS = Path(os.environ.get("ATTNCHAT_SHOTS", "")) if os.environ.get("ATTNCHAT_SHOTS") else None


def files():
    return {
        "Tiny-Instruct-Q4_K_M.gguf": gguf_bytes(payload=300_000, seed=1, **SHAPE),
        "Tiny-Instruct-Q8_0.gguf": gguf_bytes(payload=500_000, seed=2, **SHAPE),
        "Tiny-Instruct-F32.gguf": gguf_bytes(payload=1_500_000, seed=3, **SHAPE),
        "Tiny-Instruct-F16-00001-of-00002.gguf": gguf_bytes(payload=600_000, seed=4, **SHAPE),
        "Tiny-Instruct-F16-00002-of-00002.gguf": b"y" * 600_000,
    }


def service(**kw) -> HubService:
    """The real Hub functions and planner, with the free memory fixed so the badges are known."""
    def fit(size, shape, context, device, block_type=None):
        if block_type is None:   # a catalog entry: its file name's
            block_type = entry_block_type(shape)
        return runtime.fit(size, layers=shape.n_layers, kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
                           context=context, windows=getattr(shape, "windows", None), device="cpu",
                           free_bytes=FREE, block_type=block_type, architecture=shape.architecture).to_dict()

    return HubService(fit=fit, device=lambda: "cpu", **kw)


def shot(widget, name, tmp_path):
    path = (SHOTS or tmp_path) / name
    assert widget.grab().save(str(path))


def open_dialog(qtbot, window):
    d = window.model_switcher.open()
    d.resize(900, 560)
    d.tabs.setCurrentIndex(d.HUB)
    qtbot.wait(20)
    return d


@pytest.mark.skipif(not ggml_ops.available(), reason="the badges below are ggml's (without it Q8_0 runs widened)")
def test_search_fit_badges_license_download_and_load(qtbot, make_window, hub, tmp_path):
    hub.add_repo(REPO, files(), downloads=900, license="apache-2.0")
    hub.add_repo("other/tiny-mamba-GGUF", {"m-Q4_K_M.gguf": gguf_bytes("mamba", payload=1000)}, downloads=5,
                 architecture="mamba")
    w = make_window()
    w.model_switcher.service = service()
    d = open_dialog(qtbot, w)
    b = d.browser
    b.query.setText("tiny")
    with qtbot.waitSignal(b.results.model().rowsInserted, timeout=10000):
        b.search()
    assert [b.results.item(i).text() for i in range(b.results.count())] == [
        f"{REPO}\n900 downloads · apache-2.0", "other/tiny-mamba-GGUF\n5 downloads · apache-2.0 · mamba: not supported"]
    b.results.setCurrentRow(0)
    qtbot.waitUntil(lambda: b.repo is not None, timeout=10000)
    table = [[b.files.item(r, c).text() for c in range(4)] for r in range(b.files.rowCount())]
    sizes = {n: len(v) for n, v in files().items()}
    assert table == [
        ["Q4_K_M", f"{size_text(sizes['Tiny-Instruct-Q4_K_M.gguf'])}", "fits", ""],
        ["Q8_0", f"{size_text(sizes['Tiny-Instruct-Q8_0.gguf'])}", "tight", ""],
        ["F16", f"{size_text((sizes['Tiny-Instruct-F16-00001-of-00002.gguf'] + 600_000))}", "split in 2 files", ""],
        ["F32", f"{size_text(sizes['Tiny-Instruct-F32.gguf'])}", "does not fit", ""],
    ]
    q8 = sizes["Tiny-Instruct-Q8_0.gguf"]
    assert b.files.item(1, 2).toolTip() == (
        "Runs here from its Q8_0 blocks (ggml kernels)\n"
        f"Weights {size_text(q8)} (as it loads) + KV cache {size_text(KV16_AT_2048)} at 2,048 tokens (float16) = "
        f"{size_text((q8 + KV16_AT_2048))}\nFree memory on cpu: {size_text(FREE)}; this takes "
        f"{100 * (q8 + KV16_AT_2048) / FREE:.0f} % of it (over 80 % is tight)")
    f32 = next(f for f in b.repo["files"] if f["quant"] == "F32")["fit"]   # a float file: float32, as it loads
    assert (f32["cache_dtype"], f32["kv_bytes"]) == ("float32", KV_AT_2048)
    assert "License: <b>apache-2.0</b>" in b.notice.text() and "By downloading a file you accept it" in b.notice.text()
    assert b.files.currentRow() == 0 and b.download_button.isEnabled() and not b.load_button.isEnabled()
    b.files.selectRow(2)   # the split one cannot be downloaded
    assert not b.download_button.isEnabled()
    b.files.selectRow(1)
    shot(d, "hub-browser.png", tmp_path)

    with qtbot.waitSignal(b.downloaded, timeout=10000) as got:
        b.download_button.click()
    path = Path(got.args[0])
    assert path == models.hub.hub_path(REPO, "Tiny-Instruct-Q8_0.gguf") and path.read_bytes() == files()[
        "Tiny-Instruct-Q8_0.gguf"]
    assert b.files.item(1, 3).text() == "downloaded" and b.load_button.isEnabled() and not b.download_button.isEnabled()
    assert b.status.text() == "Downloaded and checked against its SHA-256: Tiny-Instruct-Q8_0.gguf"
    assert b.status.toolTip() == str(path)
    # The first tab lists the download now.
    rows = [d.list.item(i).text() for i in range(d.list.count())]
    assert rows[-1] == f"Tiny-Instruct-Q8_0\ndownloaded · apache-2.0 · {REPO}"
    shot(d, "hub-downloaded.png", tmp_path)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000) as loaded:
        b.load_button.click()
    assert loaded.args[0]["path"] == str(path)


def test_each_quant_says_whether_it_runs_here(qtbot, make_window, hub):
    """The badge and the tooltips mark a quant that runs from its blocks (on which kernel),
    one that runs widened (the copies' memory in its fit) and one that will not run."""
    hub.add_repo(REPO, {f"Tiny-Instruct-{q}.gguf": gguf_bytes(payload=100_000, seed=i, **SHAPE)
                        for i, q in enumerate(("IQ4_XS", "Q2_K", "Q1_0"))}, license="apache-2.0")
    says = {"IQ4_XS": dict(runs="blocks", kernel="ggml", why=""),
            "Q2_K": dict(runs="widened", kernel="float16 copy", why="no cuda kernel takes Q2_K blocks"),
            "Q1_0": dict(runs="no", kernel="", why="only ggml decodes Q1_0 and ggml does not load here (test)")}
    w = make_window()
    w.model_switcher.service = service(runs=lambda t, device: {"block_type": t, "bits_per_weight": 2.625, **says[t]})
    d = open_dialog(qtbot, w)
    d.browser.open_repo(REPO)
    b = d.browser
    qtbot.waitUntil(lambda: b.repo is not None, timeout=10000)
    rows = {b.files.item(r, 0).text(): r for r in range(b.files.rowCount())}
    size = b.repo["files"][0]["size_bytes"]
    extra = int(size * 8 / 2.625) * 2
    assert b.files.item(rows["IQ4_XS"], 0).toolTip().splitlines()[1] == "Runs here from its IQ4_XS blocks (ggml kernels)"
    assert b.files.item(rows["Q2_K"], 2).toolTip().splitlines()[:2] == [
        f"Runs widened: float16 copies take {size_text(extra)} more (no cuda kernel takes Q2_K blocks)",
        f"Weights {size_text((size + extra))} (as it loads) + KV cache {size_text(KV16_AT_2048)} at 2,048 tokens "
        f"(float16) = {size_text((size + extra + KV16_AT_2048))}"]
    assert b.files.item(rows["Q1_0"], 2).text() == "will not run"
    assert b.files.item(rows["Q1_0"], 2).toolTip() == ("Will not run here: only ggml decodes Q1_0 and ggml does not "
                                                       "load here (test)")


def test_cancel_keeps_the_part_and_resume_finishes_it(qtbot, make_window, hub, tmp_path):
    hub.add_repo(REPO, files())
    hub.throttle_s = 0.02       # 64 KiB every 20 ms: the download takes about 0.2 s
    w = make_window()
    w.model_switcher.service = service()
    d = open_dialog(qtbot, w)
    b = d.browser
    b.open_repo(REPO)
    qtbot.waitUntil(lambda: b.repo is not None, timeout=10000)
    b.files.selectRow(1)
    b.download_button.click()
    qtbot.waitUntil(lambda: b.bar.maximum() == 1000 and b.bar.value() > 0, timeout=10000)
    assert b.cancel_button.isEnabled() and not b.download_button.isEnabled()
    b.cancel_button.click()
    qtbot.waitUntil(lambda: b.status.text().startswith("Cancelled."), timeout=10000)
    kept = models.hub.partial_bytes(hub.repos[REPO].sha("Tiny-Instruct-Q8_0.gguf"))
    assert kept > 0 and kept % 65536 == 0
    assert b.status.text() == (f"Cancelled. {size_text(kept)} downloaded are kept hidden in the model folder: "
                               "Resume continues from there.")
    assert b.download_button.text() == "Resume" and b.download_button.isEnabled()
    assert not models.hub.hub_path(REPO, "Tiny-Instruct-Q8_0.gguf").exists()
    shot(d, "hub-cancelled.png", tmp_path)
    with qtbot.waitSignal(b.downloaded, timeout=10000):
        b.download_button.click()
    assert hub.hits("cdn", "GET")[-1].range == f"bytes={kept}-"
    assert models.hub.hub_path(REPO, "Tiny-Instruct-Q8_0.gguf").read_bytes() == files()["Tiny-Instruct-Q8_0.gguf"]
    d.close()


def test_a_gated_repo_says_so_before_and_after(qtbot, make_window, hub, tmp_path):
    hub.add_repo(REPO, files(), gated="manual", license="llama3.2")
    w = make_window()
    w.model_switcher.service = service()
    d = open_dialog(qtbot, w)
    b = d.browser
    b.open_repo(REPO)
    qtbot.waitUntil(lambda: b.repo is not None, timeout=10000)
    notice = b.notice.text()
    assert "License: <b>llama3.2</b>" in notice and "<b>Gated:</b> accept its terms at" in notice
    assert "<code>hf auth login</code>" in notice
    # The shape could not be read without access: the fit is unknown, and says why.
    assert b.files.item(0, 2).text() == "unknown" and "Fit unknown:" in b.header.text()
    b.download_button.click()
    qtbot.waitUntil(b.banner.isVisible, timeout=10000)
    assert "is gated: accept its terms at" in b.banner.text() and "hf auth login" in b.banner.text()
    shot(d, "hub-gated.png", tmp_path)
    d.close()


def test_offline_says_so_and_shows_the_models_here(qtbot, make_window, hub, monkeypatch, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    w = make_window()
    w.model_switcher.service = service()
    d = open_dialog(qtbot, w)
    b = d.browser
    b.query.setText("qwen")
    b.search()
    qtbot.waitUntil(lambda: d.tabs.currentIndex() == d.LOCAL, timeout=10000)
    assert d.banner.isVisible() and d.banner.text().startswith(
        f"Offline: searching the Hub for 'qwen': cannot reach the Hugging Face Hub at http://127.0.0.1:{port}")
    assert d.banner.text().endswith("(no connection could be made). The models on this computer are listed below.")
    assert d.list.count() == len(models.CATALOG)
    shot(d, "hub-offline.png", tmp_path)
    d.close()


def test_the_offline_note_reads_in_the_dark_palette(qtbot, make_window, qapp):
    """Its pale yellow kept the palette's text colour: near white in the dark palette."""
    from desktop.app import apply_theme

    kept = qapp.palette()
    apply_theme(qapp, "dark")
    try:
        w = make_window()
        w.model_switcher.service = service()
        d = open_dialog(qtbot, w)
        d.show_offline("cannot reach the Hugging Face Hub at https://huggingface.co (no connection could be made)")
        d.show()
        qtbot.waitUntil(lambda: d.banner.isVisible(), timeout=2000)
        image = d.banner.grab().toImage()
        colours = {image.pixelColor(x, y).lightness() for x in range(0, image.width(), 2)
                   for y in range(0, image.height(), 2)}
        # The background (#fff4ce, lightness 230) and text at most half as light: ink, not white.
        assert max(colours) >= 225 and min(colours) < 100
        d.close()
    finally:
        qapp.setPalette(kept)


def test_a_catalog_model_from_the_hub_downloads_with_progress_cancel_and_resume(qtbot, make_window, hub, tmp_path):
    from models import catalog

    repo = hub.add_repo(REPO, files())
    hub.throttle_s = 0.02
    name = "Tiny-Instruct-Q8_0.gguf"
    entry = catalog._hub("tiny-q8", "Tiny Q8", REPO, name, sha256=repo.sha(name), size=len(repo.files[name]),
                         revision=COMMIT, architecture="llama", parameters=1_000_000, n_layers=3, n_kv_heads=2,
                         head_dim=32, context_length=2048, license="Apache-2.0",
                         license_url="https://www.apache.org/licenses/LICENSE-2.0", description="A tiny test model.")
    w = make_window()
    d = ModelsDialog(w, catalog=(entry,), service=service())
    assert "from the Hugging Face Hub (hf.co/owner/Tiny-Instruct-GGUF/Tiny-Instruct-Q8_0.gguf)" in d.details.text()
    assert "<b>Fits this machine:</b> tight" in d.details.text()
    dl = d._download()
    assert "from the Hugging Face Hub (hf.co/owner/Tiny-Instruct-GGUF/Tiny-Instruct-Q8_0.gguf)" in dl.intro.text()
    dl.download_button.click()
    qtbot.waitUntil(lambda: dl.bar.maximum() == 1000 and dl.bar.value() > 0, timeout=10000)
    assert f" of {size_text(len(repo.files[name]))} · " in dl.bar.format() and " %" in dl.bar.format()
    dl.cancel_button.click()
    qtbot.waitUntil(lambda: dl.status.text().startswith("Cancelled."), timeout=10000)
    assert dl.status.text() == "Cancelled. What arrived is kept hidden in the model folder: Retry resumes from there."
    kept = models.hub.partial_bytes(repo.sha(name))
    assert kept > 0
    with qtbot.waitSignal(dl.downloaded, timeout=10000) as got:
        dl.retry_button.click()
    assert hub.hits("cdn", "GET")[-1].range == f"bytes={kept}-"
    assert Path(got.args[0]).read_bytes() == repo.files[name] and models.installed_path(entry) == Path(got.args[0])


def test_model_option_with_a_reference_opens_the_hub_tab_or_loads_the_download(qtbot, make_window, hub):
    from desktop.app import start_model

    repo = hub.add_repo(REPO, files())
    w = make_window(load=False)
    w.model_switcher.service = service()
    assert start_model(w, f"hf.co/{REPO}:Q8_0") is None
    d = w.model_switcher.dialog
    assert d.isVisible() and d.tabs.currentIndex() == d.HUB and d.browser.query.text() == REPO
    qtbot.waitUntil(lambda: d.browser.repo is not None, timeout=10000)
    d.close()
    models.hub.fetch_hub(f"hf.co/{REPO}:Q8_0")
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000) as loaded:
        start_model(w, f"hf.co/{REPO}:Q8_0")
    assert loaded.args[0]["path"] == str(models.hub.hub_path(REPO, "Tiny-Instruct-Q8_0.gguf"))
    assert repo.sha("Tiny-Instruct-Q8_0.gguf")


def test_download_words_for_a_window():
    """Hub errors said "ReadTimeout" and "the same command resumes" (a command-line phrase in a window);
    the bar said only a busy state."""
    from desktop.download_words import DownloadRate, for_window

    said = for_window("downloading hf.co/o/r/f.gguf: the connection to the Hugging Face Hub broke (ReadTimeout); "
                      "check the network connection and try again; the 40 MB of 98 MB downloaded so far are kept: "
                      "the same command resumes")
    assert "(the Hub stopped answering)" in said and said.endswith("Resume (or Retry) continues from there")
    assert "ReadTimeout" not in said and "command" not in said
    said = for_window("opening hf.co/o/r: hf.co/o/r has no file 'x.gguf'; `attnchat models files hf.co/o/r` lists "
                      "its GGUF files")
    assert said.endswith("the Hugging Face Hub tab of File > Models… lists its GGUF files") and "`" not in said
    t = [0.0]
    rate = DownloadRate(clock=lambda: t[0])
    assert rate.text(0, 100_000_000) == "0.0 of 95.4 MiB · 0 %"
    for s in range(6):
        t[0] = float(s)
        rate.add(s * 2_000_000)
    assert rate.text(10_000_000, 100_000_000) == "9.5 of 95.4 MiB · 10 % · 1.9 MiB/s · about 45 s left"
    t[0] = 75.0
    assert rate.elapsed() == "1 min 15 s"


def test_a_download_that_times_out_keeps_the_hub_tab(qtbot, make_window):
    w = make_window()
    w.model_switcher.service = service()
    d = open_dialog(qtbot, w)
    with qtbot.assertNotEmitted(d.browser.offline):
        d.browser._download_failed("downloading hf.co/o/r/f.gguf: the connection to the Hugging Face Hub broke "
                                   "(ReadTimeout); check the network connection and try again", "offline")
    assert d.tabs.currentIndex() == d.HUB
    assert d.browser.banner.text() == ("Offline: downloading hf.co/o/r/f.gguf: the connection to the Hugging Face Hub "
                                       "broke (the Hub stopped answering); check the network connection and try again")
    d.close()
