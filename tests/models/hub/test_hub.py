"""models.hub against the stand-in Hub: search, listing, shapes, and every way a download
ends (done, resumed, refused, cancelled) with what is left on disk each time."""
from __future__ import annotations

import hashlib

import pytest

import models
from models.errors import FetchCancelled, HubError
from models.hub import download, local
from models.hub.gguf_meta import read_shape
from tests.hub_stand_in import COMMIT, gguf_bytes
from tests.models.hub.repos import REPO, fetch_error, only_files, tiny_repo


def test_search_most_downloaded_first(hub):
    tiny_repo(hub, "a/Tiny-Instruct-GGUF", downloads=10)
    tiny_repo(hub, "b/tiny-chat-GGUF", downloads=5000, gated="manual", license="llama3.2")
    tiny_repo(hub, "c/Other-GGUF", downloads=99999)
    tiny_repo(hub, "d/tiny-mamba-GGUF", downloads=7, architecture="mamba")
    hits = models.hub.search("tiny")
    assert [(h.repo_id, h.downloads, h.gated, h.license, h.supported) for h in hits] == [
        ("b/tiny-chat-GGUF", 5000, "manual", "llama3.2", True), ("a/Tiny-Instruct-GGUF", 10, False, "apache-2.0", True),
        ("d/tiny-mamba-GGUF", 7, False, "apache-2.0", False)]
    assert hits[0].ref == "hf.co/b/tiny-chat-GGUF" and hits[0].context_length == 2048
    (req,) = hub.hits("hub", "GET", "/api/models")
    assert not req.has_token


def test_listing_groups_files_with_sizes_and_sha256(hub):
    repo = tiny_repo(hub)
    listing = models.hub.repo_listing(REPO)
    assert listing.commit == COMMIT and listing.license == "apache-2.0" and listing.supported is True
    assert [(g.name, g.quant, g.size_bytes, g.split) for g in listing.ggufs] == [
        ("Tiny-Instruct-Q4_K_M.gguf", "Q4_K_M", len(repo.files["Tiny-Instruct-Q4_K_M.gguf"]), False),
        ("Tiny-Instruct-Q8_0.gguf", "Q8_0", len(repo.files["Tiny-Instruct-Q8_0.gguf"]), False),
        ("Tiny-Instruct-F16-00001-of-00002.gguf", "F16",
         len(repo.files["Tiny-Instruct-F16-00001-of-00002.gguf"]) + 600_000, True)]
    assert listing.ggufs[0].parts[0].sha256 == repo.sha("Tiny-Instruct-Q4_K_M.gguf")


def test_listing_falls_back_to_the_tree_without_files_metadata(hub, monkeypatch):
    repo = tiny_repo(hub)
    original = hub.model_json
    monkeypatch.setattr(hub, "model_json", lambda r, blobs: original(r, False))  # a Hub that ignores blobs=true
    listing = models.hub.repo_listing(REPO)
    assert listing.ggufs[0].size_bytes == len(repo.files["Tiny-Instruct-Q4_K_M.gguf"])
    assert listing.ggufs[0].parts[0].sha256 == repo.sha("Tiny-Instruct-Q4_K_M.gguf")
    assert hub.hits("hub", "GET", f"/api/models/{REPO}/tree/{COMMIT}")


def test_remote_shape_reads_only_the_start(hub):
    tiny_repo(hub)
    listing = models.hub.repo_listing(REPO)
    shape = models.hub.remote_shape(REPO, listing.ggufs[1], listing.commit)
    assert (shape.architecture, shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.context_length) \
        == ("llama", 3, 4, 2, 32, 2048)
    assert shape.windows == (None,) * 3 and shape.kv_bytes_at(1000) == 2 * 3 * 2 * 32 * 4 * 1000
    ranges = [r.range for r in hub.hits("cdn", "GET")]
    assert ranges == ["bytes=0-262143"]  # one block of 256 KiB, of a 500 KB file


@pytest.mark.parametrize("arch, window, pattern", [
    ("gemma3", 512, (512, 512, 512, 512, 512, None, 512)),
    ("gemma2", 4096, (4096, None, 4096, None, 4096, None, 4096)),
    ("phi3", 2047, (2047,) * 7),
    ("qwen2", 1024, (None,) * 7),
    ("phi3", 262144, (None,) * 7),   # a window past the context is no window
])
def test_shape_windows_per_family(arch, window, pattern):
    data = gguf_bytes(arch, layers=7, sliding_window=window, context=8192, tokenizer_first=False)
    assert read_shape(lambda o, n: data[o:o + n]).windows == pattern


def test_shape_with_the_tokenizer_first_still_reads():
    data = gguf_bytes("qwen3", layers=5, tokenizer_first=True)
    assert read_shape(lambda o, n: data[o:o + n]).n_layers == 5


def test_fetch_by_quant_tag(hub):
    repo = tiny_repo(hub)
    seen = []
    path = models.hub.fetch_hub(f"hf.co/{REPO}:q8_0", progress=lambda d, t: seen.append((d, t)))
    folder = models.models_dir()
    assert path == folder / "hf.co" / "owner" / "Tiny-Instruct-GGUF" / "Tiny-Instruct-Q8_0.gguf"
    assert path.read_bytes() == repo.files["Tiny-Instruct-Q8_0.gguf"]
    size = len(repo.files["Tiny-Instruct-Q8_0.gguf"])
    assert seen[0] == (0, size) and seen[-1] == (size, size)
    manifest = local.read_manifest(path)
    assert manifest["sha256"] == repo.sha("Tiny-Instruct-Q8_0.gguf") and manifest["commit"] == COMMIT
    assert manifest["size_bytes"] == size and manifest["license"] == "apache-2.0" and manifest["quant"] == "Q8_0"
    assert only_files(folder) == ["hf.co/owner/Tiny-Instruct-GGUF/.Tiny-Instruct-Q8_0.gguf.json",
                                  "hf.co/owner/Tiny-Instruct-GGUF/Tiny-Instruct-Q8_0.gguf"]
    assert not (folder / ".partial").exists()   # the part moved out: no empty folder left
    # Resolved at the revision listed (main); the token-free CDN sent the bytes.
    assert hub.hits("hub", "HEAD", f"/{REPO}/resolve/main/Tiny-Instruct-Q8_0.gguf")
    assert [r.range for r in hub.hits("cdn", "GET")] == [None]
    # A second fetch downloads nothing; resolve_hub finds it without the network.
    n = len(hub.requests)
    assert models.hub.fetch_hub(f"hf.co/{REPO}:Q8_0") == path
    assert not hub.hits("cdn")[1:] and len(hub.hits("hub", "HEAD")) == 1
    hub.stop()
    assert models.hub.resolve_hub(f"hf.co/{REPO}:Q8_0") == path
    assert len(hub.requests) == n + 1  # the listing only, before the stop


def test_fetch_without_a_tag_takes_q4_k_m_and_lists_it(hub):
    tiny_repo(hub)
    path = models.hub.fetch_hub(f"hf.co/{REPO}")
    assert path.name == "Tiny-Instruct-Q4_K_M.gguf"
    rows = [r for r in models.list_models() if r.source == "hub"]
    assert [(r.id, r.installed, r.size_bytes, r.license) for r in rows] == [
        (f"hf.co/{REPO}/Tiny-Instruct-Q4_K_M.gguf", True, path.stat().st_size, "apache-2.0")]


def test_resume_after_a_dropped_connection(hub, monkeypatch):
    import huggingface_hub.file_download as fd

    repo = tiny_repo(hub)
    name = "Tiny-Instruct-Q8_0.gguf"
    monkeypatch.setattr(fd.time, "sleep", lambda s: None)   # a retry waits 1 s before resuming
    hub.drop(REPO, name, 200_000)  # 3 whole chunks of 64 KiB written, the 4th lost with the connection
    path = models.hub.fetch_hub(f"hf.co/{REPO}/{name}")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == repo.sha(name)
    assert [r.range for r in hub.hits("cdn", "GET")] == [None, "bytes=196608-"]


def test_resume_in_a_later_run_after_the_network_went_away(hub, monkeypatch):
    import huggingface_hub.file_download as fd

    repo = tiny_repo(hub)
    name = "Tiny-Instruct-Q8_0.gguf"
    monkeypatch.setattr(fd.time, "sleep", lambda s: None)
    # 2 chunks of 64 KiB, then five retries in a row each get nothing: the network is gone.
    hub.drop(REPO, name, 131_072, 0, 0, 0, 0, 0)
    with pytest.raises(HubError) as info:
        models.hub.fetch_hub(f"hf.co/{REPO}/{name}")
    assert info.value.kind == "offline"
    assert str(info.value) == (f"downloading hf.co/{REPO}/{name}: the connection to the Hugging Face Hub broke "
                               "(RemoteProtocolError); check the network connection and try again; the 128.0 KiB of "
                               "492.6 KiB downloaded so far are kept: the same command resumes")
    assert [r.range for r in hub.hits("cdn", "GET")] == [None] + ["bytes=131072-"] * 5
    folder = models.models_dir()
    assert only_files(folder) == [f".partial/{repo.sha(name)}.part"]
    assert (folder / ".partial" / f"{repo.sha(name)}.part").stat().st_size == 131_072
    # The next run resumes from byte 131,072 and checks the whole file.
    path = models.hub.fetch_hub(f"hf.co/{REPO}/{name}")
    assert path.read_bytes() == repo.files[name]
    assert hub.hits("cdn", "GET")[-1].range == "bytes=131072-"
    assert only_files(folder) == [f"hf.co/owner/Tiny-Instruct-GGUF/.{name}.json", f"hf.co/owner/Tiny-Instruct-GGUF/{name}"]


# ---- refusals: one line each, and what is left on disk ------------------------------------------

def test_sha_mismatch_is_refused_with_nothing_stored(hub):
    name = "Tiny-Instruct-Q8_0.gguf"
    good = gguf_bytes(payload=500_000, seed=2)
    bad = bytearray(good)
    bad[-1] ^= 0xFF   # one flipped bit at the end: same size, other sha256
    repo = tiny_repo(hub, files={name: good}, served={name: bytes(bad)})
    err = fetch_error(f"hf.co/{REPO}:Q8_0")
    got = hashlib.sha256(bad).hexdigest()
    assert err.kind == "checksum"
    assert str(err) == (f"checksum mismatch for hf.co/{REPO}/{name}: the bytes downloaded have sha256 {got[:12]}..., "
                        f"the Hub's LFS metadata say {repo.sha(name)[:12]}...; nothing was kept; try again")
    assert only_files(models.models_dir()) == []
    assert not (models.models_dir() / ".partial").exists()   # not even an empty folder for the part


def test_missing_repo_and_file_are_404s(hub):
    tiny_repo(hub)
    err = fetch_error("hf.co/owner/No-Such-GGUF:Q4_K_M")
    assert err.kind == "not_found"
    assert str(err) == ("listing hf.co/owner/No-Such-GGUF: hf.co/owner/No-Such-GGUF: no such model repo on the Hub "
                        "(or it is private); check the name with `attnchat models search TEXT`, or log in with "
                        "`hf auth login` if it is yours")
    err = fetch_error(f"hf.co/{REPO}/Tiny-Instruct-Q3_K_M.gguf")
    assert err.kind == "ref" and str(err).startswith(f"hf.co/{REPO} has no file 'Tiny-Instruct-Q3_K_M.gguf'; its GGUF files:")
    # A file the listing has but resolve does not (deleted in between): the Hub's 404 EntryNotFound.
    listing = models.hub.repo_listing(REPO)
    del hub.repos[REPO].files["Tiny-Instruct-Q8_0.gguf"]
    with pytest.raises(HubError) as info:
        download.download_file(REPO, listing.revision, listing.ggufs[1].parts[0])
    assert info.value.kind == "not_found" and "has no file 'Tiny-Instruct-Q8_0.gguf'" in str(info.value)
    assert only_files(models.models_dir()) == []


def test_not_enough_disk_is_said_before_downloading(hub, monkeypatch):
    tiny_repo(hub)
    monkeypatch.setattr(download, "_free_bytes", lambda path: 10_000_000)
    err = fetch_error(f"hf.co/{REPO}:Q4_K_M")
    assert err.kind == "disk_full" and str(err).startswith(
        f"not enough disk space for hf.co/{REPO}/Tiny-Instruct-Q4_K_M.gguf: 297.3 KiB more needed in ")
    assert "9.5 MiB free" in str(err)
    assert not hub.hits("cdn") and only_files(models.models_dir()) == []


def test_disk_filling_up_midway_keeps_nothing(hub, monkeypatch):
    import errno

    tiny_repo(hub)
    real_write = download.Writer.write

    def write(self, data):
        if self.done >= 128 << 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(download.Writer, "write", write)
    err = fetch_error(f"hf.co/{REPO}:Q8_0")
    assert err.kind == "disk_full" and "the disk filled up while downloading" in str(err) and "nothing was kept" in str(err)
    assert only_files(models.models_dir()) == []


def test_cancel_keeps_the_part_and_the_next_fetch_resumes(hub):
    repo = tiny_repo(hub)
    name = "Tiny-Instruct-Q8_0.gguf"
    seen = []
    with pytest.raises(FetchCancelled, match="was cancelled"):
        models.hub.fetch_hub(f"hf.co/{REPO}:Q8_0", progress=lambda d, t: seen.append(d),
                             cancel=lambda: bool(seen) and seen[-1] >= 3 * 65536)
    folder = models.models_dir()
    assert only_files(folder) == [f".partial/{repo.sha(name)}.part"]   # nothing in the model folder proper
    assert models.hub.find_installed(models.hub.parse_ref(f"hf.co/{REPO}:Q8_0")) is None
    assert all(r.source != "hub" for r in models.list_models())
    seen.clear()
    path = models.hub.fetch_hub(f"hf.co/{REPO}:Q8_0", progress=lambda d, t: seen.append(d))
    assert path.read_bytes() == repo.files[name]
    assert seen[0] == 3 * 65536 and hub.hits("cdn", "GET")[-1].range == f"bytes={3 * 65536}-"


def test_ctrl_c_keeps_the_part_for_a_resume(hub):
    repo = tiny_repo(hub)

    def interrupt(done, total):
        if done >= 65536:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        models.hub.fetch_hub(f"hf.co/{REPO}:Q8_0", progress=interrupt)
    assert only_files(models.models_dir()) == [f".partial/{repo.sha('Tiny-Instruct-Q8_0.gguf')}.part"]


def test_split_and_unsupported_models_are_refused_before_downloading(hub):
    tiny_repo(hub)
    tiny_repo(hub, "o/mamba-GGUF", architecture="mamba")
    err = fetch_error(f"hf.co/{REPO}:F16")
    assert err.kind == "split" and str(err).startswith(
        f"hf.co/{REPO}/Tiny-Instruct-F16-00001-of-00002.gguf is split into 2 files; attnchat loads single-file GGUFs only")
    err = fetch_error("hf.co/o/mamba-GGUF:Q8_0")
    assert err.kind == "unsupported" and "is a 'mamba' model, which attnchat's decoder does not run" in str(err)
    assert not hub.hits("cdn") and not hub.hits(method="HEAD")


def test_a_file_without_lfs_metadata_is_refused(hub):
    tiny_repo(hub, lfs=False)
    err = fetch_error(f"hf.co/{REPO}:Q4_K_M")
    assert err.kind == "checksum" and "has no LFS sha256 on the Hub to check it against" in str(err)
    assert only_files(models.models_dir()) == []


def test_a_catalog_checksum_must_agree_with_the_hubs(hub):
    tiny_repo(hub)
    err = fetch_error(f"hf.co/{REPO}:Q4_K_M", expected_sha256="ab" * 32)
    assert err.kind == "checksum" and "is not the file the catalog names (abababababab...)" in str(err)
    assert not hub.hits("cdn")


# ---- models.resolve: what --model takes -------------------------------------------------------

def test_resolve_paths_catalog_ids_and_references(hub, tmp_path, monkeypatch):
    import dataclasses

    from models import catalog

    repo = tiny_repo(hub)
    own = tmp_path / "mine.gguf"
    own.write_bytes(b"GGUF")
    assert models.resolve(str(own)) == own
    # A catalog entry served by the Hub: its id and its repo without a tag both give its file.
    entry = dataclasses.replace(catalog.DEFAULT_MODEL, id="tiny-q8", name="Tiny", filename="Tiny-Instruct-Q8_0.gguf",
                                sha256=repo.sha("Tiny-Instruct-Q8_0.gguf"), size_bytes=len(repo.files["Tiny-Instruct-Q8_0.gguf"]),
                                pip_requirement="", wheel_filename="", wheel_member="", hub_repo=REPO,
                                hub_file="Tiny-Instruct-Q8_0.gguf")
    monkeypatch.setattr(catalog, "CATALOG", catalog.CATALOG + (entry,))
    monkeypatch.setattr(models.store, "CATALOG", catalog.CATALOG)
    assert models.installed_path(entry) is None
    path = models.resolve("tiny-q8")
    assert path == models.models_dir() / "hf.co" / REPO / "Tiny-Instruct-Q8_0.gguf"
    assert models.installed_path(entry) == path and models.verify(entry)
    n = len(hub.requests)
    assert models.resolve(f"hf.co/{REPO}") == path      # the catalog's file, found locally
    assert len(hub.requests) == n
    assert models.resolve(f"hf.co/{REPO}:Q4_K_M").name == "Tiny-Instruct-Q4_K_M.gguf"   # a tag: that quant
    # The catalog row stays one row; the other download is a hub row.
    rows = models.list_models()
    assert [r.id for r in rows if r.source == "hub"] == [f"hf.co/{REPO}/Tiny-Instruct-Q4_K_M.gguf"]
    assert next(r for r in rows if r.id == "tiny-q8").path == path
    with pytest.raises(models.FetchError) as info:
        models.resolve("no-such-model")
    assert str(info.value).startswith("no-such-model: no such file, catalog model or Hub reference; give a .gguf file")


def test_a_catalog_entry_is_fetched_at_its_pinned_revision_or_main_when_gone(hub, monkeypatch):
    import dataclasses

    from models import catalog

    repo = tiny_repo(hub)
    name = "Tiny-Instruct-Q4_K_M.gguf"
    entry = catalog._hub("tiny", "Tiny", REPO, name, sha256=repo.sha(name), size=len(repo.files[name]),
                         revision=COMMIT, architecture="llama", parameters=1, n_layers=3, n_kv_heads=2, head_dim=32,
                         context_length=2048, license="x", description="x")
    path = models.fetch_model(entry)
    assert path.read_bytes() == repo.files[name] and models.installed_path(entry) == path
    assert hub.hits("hub", "GET", f"/api/models/{REPO}/revision/{COMMIT}")
    assert hub.hits("hub", "HEAD", f"/{REPO}/resolve/{COMMIT}/{name}")
    path.unlink()
    # A revision the Hub no longer has (a squashed history): main, where the sha256 must still match.
    gone = dataclasses.replace(entry, hub_revision="f" * 40)
    assert models.fetch_model(gone) == path and path.read_bytes() == repo.files[name]
    assert hub.hits("hub", "GET", f"/api/models/{REPO}/revision/{'f' * 40}")
    # An entry picked by its tag (file name not checked) is found installed by that tag.
    by_tag = dataclasses.replace(entry, hub_file="", hub_quant="Q4_K_M", sha256="")
    assert models.installed_path(by_tag) == path
    assert models.installed_path(dataclasses.replace(by_tag, hub_quant="Q8_0")) is None


def test_a_push_between_listing_and_download_is_caught(hub):
    repo = tiny_repo(hub)
    listing = models.hub.repo_listing(REPO)
    name = "Tiny-Instruct-Q8_0.gguf"
    repo.files[name] = gguf_bytes(payload=500_000, seed=99)      # re-uploaded on main meanwhile
    hub.blobs[repo.sha(name)] = repo.files[name]
    with pytest.raises(HubError) as info:
        download.download_file(REPO, listing.revision, listing.ggufs[1].parts[0])
    assert info.value.kind == "checksum" and str(info.value).startswith(
        f"the Hub's answers about hf.co/{REPO}/{name} disagree (listed sha256 ")
    assert not hub.hits("cdn") and only_files(models.models_dir()) == []
