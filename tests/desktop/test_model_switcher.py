"""File > Models…: both catalog models listed with their state; the one not downloaded shows its
size and license before anything is fetched; a download or a Load switches the window's model."""
from __future__ import annotations

from pathlib import Path

import pytest
import models
from desktop.download_dialog import DownloadDialog

SMOL, GEMMA = models.DEFAULT_MODEL, models.get("gemma3-270m")


@pytest.fixture(autouse=True)
def no_recommendation(monkeypatch):
    """The catalog in its own order: what is recommended depends on this machine's memory and disk."""
    from desktop.model_switcher import dialog as switcher

    monkeypatch.setattr(switcher, "recommend", lambda **kw: None)


@pytest.fixture
def folder(tmp_path):
    """Installed files: the default model only, at first."""
    files = {SMOL.id: tmp_path / SMOL.filename}
    files[SMOL.id].write_bytes(b"x")
    return files


def _switcher(window, folder, fetched: list):
    def fetch(entry, progress, cancel):
        fetched.append(entry.id)
        progress(entry.size_bytes, entry.size_bytes)
        folder[entry.id] = Path(folder[SMOL.id]).with_name(entry.filename)
        return folder[entry.id]

    s = window.model_switcher
    s.installed_fn, s.fetch_fn = (lambda e: folder.get(e.id)), fetch
    return s


def test_a_model_not_downloaded_shows_size_and_license_first_then_downloads_and_loads(qtbot, make_window, folder, tmp_path):
    w = make_window(load=False)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model(str(folder[SMOL.id]))
    fetched: list = []
    d = _switcher(w, folder, fetched).open()
    assert [a.text() for a in w.file_menu.actions()].index("&Models…") == 3  # after Open model folder…
    rows = [d.list.item(i).text() for i in range(d.list.count())]
    assert rows[:2] == ["SmolLM2-135M-Instruct\nloaded · Apache-2.0",
                        "Gemma 3 270M\n241.4 MiB to download · Gemma Terms of Use"]
    assert len(rows) == len(models.CATALOG) and rows[2] == "Qwen2.5-0.5B-Instruct\n379.6 MiB to download · Apache-2.0"
    assert d.list.currentRow() == 0 and not d.load_button.isEnabled() and d.load_button.text() == "Loaded"
    assert d.download_button.isHidden()

    d.list.setCurrentRow(1)
    text = d.details.text()
    for want in ("241.4 MiB (253,113,024 bytes)", '<a href="https://ai.google.dev/gemma/terms">Gemma Terms of Use</a>',
                 "18 layers, 1 KV head of 256 (multi-query); 15 of 18 layers slide over 512 tokens",
                 "plain completion", "Not downloaded", "18,432 bytes per token in float16"):
        assert want in text, want
    assert not d.load_button.isEnabled() and not d.download_button.isHidden()
    d.show()
    qtbot.wait(50)
    assert d.grab().save(str(tmp_path / "models.png"))

    d.download_button.click()
    dl = d.download
    assert isinstance(dl, DownloadDialog) and dl.isVisible() and fetched == []  # asks first
    intro = dl.intro.text()
    assert "Switch to Gemma 3 270M." in intro and "241.4 MiB" in intro and "Gemma Terms of Use" in intro
    assert dl.grab().save(str(tmp_path / "download.png"))
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000) as loaded:
        dl.download_button.click()
    assert fetched == [GEMMA.id] and loaded.args[0]["path"] == str(folder[GEMMA.id])
    assert w.settings.get("model/source") == str(folder[GEMMA.id])


def test_load_switches_to_an_installed_model(qtbot, make_window, folder):
    folder[GEMMA.id] = folder[SMOL.id].with_name(GEMMA.filename)
    w = make_window(load=False)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model(str(folder[SMOL.id]))
    d = _switcher(w, folder, []).open()
    assert d.list.item(1).text() == "Gemma 3 270M\ninstalled · Gemma Terms of Use"
    d.list.setCurrentRow(1)
    assert d.load_button.isEnabled() and d.download_button.isHidden()
    assert f"Installed: <code>{folder[GEMMA.id]}</code>" in d.details.text()
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000) as loaded:
        d.load_button.click()
    assert loaded.args[0]["path"] == str(folder[GEMMA.id])  # and the dialog closed (deleted)
    # Opened again: the new model is the loaded one.
    again = w.model_switcher.open()
    assert again.list.currentRow() == 1 and again.load_button.text() == "Loaded"
    again.close()


def test_the_dialog_works_from_the_keyboard(qtbot, make_window, folder):
    """Ctrl+M, Down, Enter did nothing: the focus was on the tab row, not the list; the Hub
    tab took no typing until its search field was clicked."""
    from PySide6.QtCore import Qt

    folder[GEMMA.id] = folder[SMOL.id].with_name(GEMMA.filename)
    w = make_window(load=False)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model(str(folder[SMOL.id]))
    d = _switcher(w, folder, []).open()
    qtbot.waitUntil(lambda: d.list.hasFocus(), timeout=2000)
    d.tabs.setCurrentIndex(d.HUB)
    assert d.browser.query.hasFocus()
    qtbot.keyClicks(d.browser.query, "qwen")
    assert d.browser.query.text() == "qwen"
    d.tabs.setCurrentIndex(d.LOCAL)
    assert d.list.hasFocus() and d.list.currentRow() == 0
    qtbot.keyClick(d.list, Qt.Key.Key_Down)
    assert d.list.currentRow() == 1 and d.load_button.isDefault()
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000) as loaded:
        qtbot.keyClick(d.list, Qt.Key.Key_Return)
    assert loaded.args[0]["path"] == str(folder[GEMMA.id])


def test_the_catalog_names_a_license_text_for_every_model():
    assert all(e.license_url.startswith("https://") for e in models.CATALOG)


def test_a_catalog_models_fit_counts_its_sliding_windows():
    """Gemma 3 270M's fit line said 555 MB (a full cache on every layer) beside its card's 63 MiB of cache."""
    import runtime

    from desktop.model_switcher.hub_jobs import default_fit, layer_windows

    gemma = next(e for e in models.CATALOG if e.id == "gemma3-270m")
    windows = layer_windows(gemma)
    assert len(windows) == gemma.n_layers and windows.count(gemma.sliding_window) == gemma.sliding_layers
    f = default_fit(gemma.size_bytes, gemma, 8192, "cpu")
    full = runtime.fit(gemma.size_bytes, layers=gemma.n_layers, kv_heads=gemma.n_kv_heads, head_dim=gemma.head_dim,
                       context=8192, device="cpu").to_dict()
    assert f["kv_bytes"] < full["kv_bytes"] / 3
    assert abs(f["kv_bytes"] - gemma.kv_bytes_at(8192, 2)) <= 0.05 * gemma.kv_bytes_at(8192, 2)   # as its card says


def test_a_catalog_models_fit_plans_the_cache_dtype_the_runtime_gives_it():
    """The fit planned a float32 cache for a quantized GGUF on the CPU, where the runtime gives
    it float16 (twice the cache); the catalog card said "bytes per token in float32"."""
    import runtime

    from desktop.model_switcher.dialog import details_html
    from desktop.model_switcher.hub_jobs import default_fit

    want = str(runtime.default_cache_dtype("cpu", "float16", blocks=True)).removeprefix("torch.")
    assert want == "float16"
    for e in models.CATALOG:
        ctx = min(8192, e.context_length)
        f = default_fit(e.size_bytes, e, ctx, "cpu")
        assert (f["cache_dtype"], f["kv_bytes"]) == (want, e.kv_bytes_at(ctx, 2)), e.id
        card = details_html(e, "missing", None, f)
        assert f"{e.kv_bytes_per_token(2):,} bytes per token in float16; {e.kv_bytes_at(ctx, 2) / 2**20:,.1f} MiB" in card
    float_file = runtime.fit(10**8, layers=30, kv_heads=3, head_dim=64, context=100, device="cpu",
                             block_type="F16", architecture="llama")
    unmapped = runtime.fit(10**8, layers=30, kv_heads=3, head_dim=64, context=100, device="cpu",
                           block_type="Q4_K", architecture="mamba")
    assert (float_file.cache_dtype, float_file.kv_bytes) == ("float32", 100 * 46_080)   # as they load: float32
    assert (unmapped.cache_dtype, unmapped.kv_bytes) == ("float32", 100 * 46_080)


def test_a_usable_first_model_is_recommended_for_this_machine(qtbot, tmp_path, monkeypatch):
    from desktop.app import build_window
    from desktop.chat.store import Store
    from desktop.model_switcher.recommend import CPU_MAX_PARAMETERS, recommend
    from desktop.settings.values import Settings
    from desktop.sizes import size_text
    from desktop.worker import Engine, EngineWorker
    from tests.desktop.fakes import fake_load

    def fit(size, e, context, device, free=6_000_000_000):
        total = size + e.kv_bytes_at(context)
        return {"verdict": "fits" if total <= 0.8 * free else "does not fit", "total_bytes": total,
                "free_bytes": free, "context": context, "device": device}

    r = recommend(fit=fit, device="cpu", free_disk=50_000_000_000)
    chat = [e for e in models.CATALOG if e.chat_template and e.parameters <= CPU_MAX_PARAMETERS
            and fit(e.size_bytes, e, min(8192, e.context_length), "cpu")["verdict"] == "fits"]
    assert r is not None and r.entry.parameters == max(e.parameters for e in chat)
    assert "fits this machine" in r.reason and "usable speed" in r.reason
    # "of 21,845 MB free on the CPU" read oddly, in MB beside the window's MiB.
    total = size_text(r.fit["total_bytes"])
    assert f"({total} with its KV cache at 8,192 tokens, of 5.6 GiB of free memory)" in r.reason
    small = recommend(fit=fit, device="cpu", free_disk=500_000_000)   # the disk counts too
    assert small is not None and small.entry.size_bytes * 1.1 <= 500_000_000 < r.entry.size_bytes * 1.1
    big = recommend(fit=lambda *a: fit(*a, free=100_000_000_000), device="cuda:0", free_disk=10**12)
    assert big.entry.parameters > CPU_MAX_PARAMETERS   # a GPU takes the largest that fits
    assert "of 93.1 GiB free on cuda:0)" in big.reason
    # The first run offers it beside the default model.
    w = build_window(Store(tmp_path / "c.sqlite3"), Settings(tmp_path / "s.ini"), Engine(EngineWorker(load_fn=fake_load)),
                     confirm=lambda q: True)
    qtbot.addWidget(w)
    from desktop.model_switcher import dialog as switcher

    monkeypatch.setattr(switcher, "recommend", lambda **kw: r)
    w.show_first_run()
    assert w.empty.recommend_button.isVisibleTo(w)
    assert w.empty.recommend_button.text() == f"Download {r.entry.name} ({r.entry.size_bytes / 2**20:,.1f} MiB)…"
    assert "fits this machine" in w.empty.recommend_note.text()
    w.empty.recommend_button.click()
    shown = w.findChild(DownloadDialog)
    assert shown is not None and shown.entry is r.entry
    shown.close()
    w.engine.shutdown()


def test_the_recommended_model_is_listed_first_and_chosen_when_none_is_loaded(qtbot, make_window, folder, monkeypatch):
    """At its catalog place (11th of 12) it was below the fold of the list at 1100x720."""
    from desktop.model_switcher import dialog as switcher
    from desktop.model_switcher.recommend import Recommendation

    big = models.get("smollm2-1.7b-instruct")
    r = Recommendation(big, {"verdict": "fits"}, "the largest chat model in the catalog that fits this machine")
    monkeypatch.setattr(switcher, "recommend", lambda **kw: r)
    w = make_window(load=False)
    d = _switcher(w, folder, []).open()
    rows = [d.list.item(i).text() for i in range(d.list.count())]
    assert rows[0] == "SmolLM2-1.7B-Instruct\n1,010.9 MiB to download · Apache-2.0\n★ recommended for this machine"
    assert rows[1] == "SmolLM2-135M-Instruct\ninstalled · Apache-2.0" and len(rows) == len(models.CATALOG)
    assert sum("recommended" in t for t in rows) == 1
    assert d.list.currentRow() == 0 and not d.download_button.isHidden()
    assert "<b>Recommended:</b> the largest chat model in the catalog that fits this machine." in d.details.text()
    d.close()
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model(str(folder[SMOL.id]))
    again = w.model_switcher.open()   # a model loaded: that one is chosen, the recommendation stays on top
    assert again.list.currentRow() == 1 and again.load_button.text() == "Loaded"
    assert again.list.item(0).text().endswith("★ recommended for this machine")
    again.close()


@pytest.mark.parametrize("setting, value", [("model/reproducible", "on"), ("model/weight_dtype", "float32"),
                                            ("generation/cache_dtype", "float32")])
def test_the_cards_fit_follows_the_settings_the_next_load_runs_with(qtbot, make_window, folder, setting, value):
    """Reproducible replies, a float weight dtype or a float32 cache dtype give a quantized file a
    float32 cache on the CPU; the card quoted float16's bytes whatever the settings said."""
    w = make_window(load=False)
    d = _switcher(w, folder, []).open()
    d.list.setCurrentRow(0)
    half = f"{SMOL.kv_bytes_per_token(2):,} bytes per token in float16"
    assert half in d.details.text()
    d.close()
    w.settings.set(setting, value)
    d = w.model_switcher.open()
    d.list.setCurrentRow(0)
    assert f"{SMOL.kv_bytes_per_token(4):,} bytes per token in float32" in d.details.text(), d.details.text()
    assert half not in d.details.text()
    d.close()
