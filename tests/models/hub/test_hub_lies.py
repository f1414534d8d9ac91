"""A Hub that lies: names that are paths, sizes that are not the file's, bodies that do not
end, resumes that start over. Each is refused in one line, nothing is written outside the
model folder, and no part file grows past the listed size."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import models
from models.errors import HubError
from models.hub import download, local, transfer
from models.hub.report import files_report
from models.paths import UnsafeNameError, inside
from tests.hub_stand_in import gguf_bytes

REPO = "owner/Liar-GGUF"
GOOD = "Liar-Q8_0.gguf"
DATA = gguf_bytes(payload=300_000, seed=7)


def everything(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(transfer.time, "sleep", lambda s: None)
    monkeypatch.setattr(transfer, "READ_TIMEOUT_S", 1.0)


def refused(ref: str, **kw) -> HubError:
    with pytest.raises(HubError) as info:
        models.hub.fetch_hub(ref, **kw)
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
    return info.value


# ---- names ----------------------------------------------------------------------------------
BAD_NAMES = ["../../../../outside/pwned-x-Q4_K_M.gguf", "sub/../../../outside/pwned-Q4_K_M.gguf",
             "{abs}/outside/pwned-Q4_K_M.gguf", "..\\..\\outside\\pwned-Q4_K_M.gguf", "x\0-Q4_K_M.gguf",
             "./-Q4_K_M.gguf", "C:pwned-Q4_K_M.gguf"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_listed_name_that_is_a_path_is_refused_and_nothing_is_written(hub, tmp_path, name):
    name = name.format(abs=tmp_path)
    hub.add_repo(REPO, {name: DATA, GOOD: DATA})
    err = refused(f"hf.co/{REPO}:Q4_K_M")
    assert err.kind == "name" and "not a plain file name" in str(err), str(err)
    assert not (tmp_path / "outside").exists()
    assert everything(tmp_path / "models") == []
    # The listing shown by `models files` refuses the same, and writes nothing either.
    with pytest.raises(HubError) as info:
        files_report(REPO)
    assert info.value.kind == "name"
    assert not (tmp_path / "outside").exists() and everything(tmp_path / "models") == []


@pytest.mark.parametrize("lie", [{"listed_id": "../../outside"}, {"listed_id": "owner/../../x"},
                                 {"listed_sha": {GOOD: "../../../outside/x"}}])
def test_a_repo_id_or_sha256_that_is_a_path_is_refused(hub, tmp_path, lie):
    hub.add_repo(REPO, {GOOD: DATA}, **lie)
    err = refused(f"hf.co/{REPO}/{GOOD}")
    assert err.kind == "name", str(err)
    assert not (tmp_path / "outside").exists() and everything(tmp_path / "models") == []


def test_an_odd_name_of_a_file_that_is_no_model_is_left_out(hub):
    hub.add_repo(REPO, {GOOD: DATA, "../README.md": b"# hi\n"})
    path = models.hub.fetch_hub(f"hf.co/{REPO}/{GOOD}")
    assert path.read_bytes() == DATA and path.parent == models.models_dir() / "hf.co" / "owner" / "Liar-GGUF"


def test_a_link_inside_the_model_folder_that_leads_out_is_refused(hub, tmp_path):
    hub.add_repo(REPO, {GOOD: DATA})
    (tmp_path / "elsewhere").mkdir()
    (models.models_dir() / "hf.co").mkdir()
    os.symlink(tmp_path / "elsewhere", models.models_dir() / "hf.co" / "owner")
    err = refused(f"hf.co/{REPO}/{GOOD}")
    assert err.kind == "name" and "leads out of" in str(err)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_inside_checks_each_name_and_the_resolved_whole(tmp_path):
    assert inside(tmp_path, "hf.co", "o", "r", "sub", "m.gguf") == tmp_path / "hf.co" / "o" / "r" / "sub" / "m.gguf"
    for names in [("..",), ("a", ".."), ("/etc",), ("a/b",), ("a\\b",), ("",), ("x\0",), ("C:",), ("a\n",),
                  ("x" * 256,)]:
        with pytest.raises(UnsafeNameError):
            inside(tmp_path, *names)
    assert local.partial_bytes("../../etc/passwd") == 0
    with pytest.raises(HubError):
        local.part_path("../" + "0" * 61)


# ---- sizes ----------------------------------------------------------------------------------
def test_a_body_that_never_ends_is_cut_at_the_listed_size(hub, fast, monkeypatch):
    repo = hub.add_repo(REPO, {GOOD: DATA})
    hub.endless.add(repo.sha(GOOD))
    biggest = []
    real = transfer.Writer.write
    monkeypatch.setattr(transfer.Writer, "write", lambda self, d: (real(self, d), biggest.append(self.done))[0])
    err = refused(f"hf.co/{REPO}/{GOOD}")
    assert err.kind == "size"
    assert str(err) == (f"the Hub sent more than the {len(DATA):,} bytes its listing gives for hf.co/{REPO}/{GOOD}; "
                        "the download was cut there and nothing was kept; try again later")
    assert max(biggest) == len(DATA)
    assert everything(models.models_dir()) == []
    # The client stopped reading: the server could not push the rest of its 64 MB.
    assert hub.sent[repo.sha(GOOD)] < 32 << 20


def test_a_longer_content_length_is_refused_before_the_body(hub, fast):
    repo = hub.add_repo(REPO, {GOOD: DATA})
    hub.longer[repo.sha(GOOD)] = 50_000_000
    err = refused(f"hf.co/{REPO}/{GOOD}")
    assert err.kind == "size"
    assert str(err) == (f"the Hub's answers about hf.co/{REPO}/{GOOD} disagree (listed {len(DATA):,} bytes; the "
                        f"download announced {len(DATA) + 50_000_000} bytes from byte 0); nothing was kept; try again later")
    assert everything(models.models_dir()) == []
    assert len(hub.hits("cdn", "GET")) == 1


def test_resumes_answered_from_the_first_byte_give_up_after_bounded_tries(hub, fast):
    """Every GET sends the first 100,000 bytes and drops, ignoring Range: each try brings
    bytes, none brings a new one; huggingface_hub's http_get resumed forever."""
    repo = hub.add_repo(REPO, {GOOD: DATA})
    hub.ignore_range.add(repo.sha(GOOD))
    hub.drop(REPO, GOOD, *[100_000] * 40)
    err = refused(f"hf.co/{REPO}/{GOOD}")
    assert err.kind == "offline"
    assert str(err).endswith("the server does not resume downloads, so the 64.0 KiB downloaded were not kept"), str(err)
    gets = hub.hits("cdn", "GET")
    assert len(gets) == 1 + transfer.RETRIES
    assert everything(models.models_dir()) == []


def test_a_trickle_is_bounded_in_requests(hub, fast):
    """Each try brings a few new bytes, then the connection drops: MAX_ATTEMPTS requests at most."""
    big = gguf_bytes(payload=2_000_000, seed=8)
    repo = hub.add_repo(REPO, {GOOD: big})
    hub.drop(REPO, GOOD, *[70_000] * 40)   # one 64 KiB chunk kept per try
    err = refused(f"hf.co/{REPO}/{GOOD}")
    assert err.kind == "offline" and str(err).endswith("the 1.2 MiB of 1.9 MiB downloaded so far are kept: the same "
                                                       "command resumes"), str(err)
    assert len(hub.hits("cdn", "GET")) == transfer.MAX_ATTEMPTS
    part = models.models_dir() / ".partial" / f"{repo.sha(GOOD)}.part"
    assert everything(models.models_dir()) == [f".partial/{repo.sha(GOOD)}.part"]
    assert part.stat().st_size == transfer.MAX_ATTEMPTS * (64 << 10)
    hub.drops.clear()
    path = models.hub.fetch_hub(f"hf.co/{REPO}/{GOOD}")
    assert path.read_bytes() == big


def test_an_honest_download_still_works_through_the_bounds(hub, fast):
    hub.add_repo(REPO, {GOOD: DATA})
    path = models.hub.fetch_hub(f"hf.co/{REPO}/{GOOD}")
    assert path.read_bytes() == DATA
    assert download.HTTP_CHUNK == 64 << 10  # the fixture's: several chunks per file


@pytest.mark.parametrize("argv", [["models", "fetch", f"hf.co/{REPO}:Q4_K_M"], ["models", "files", f"hf.co/{REPO}"]])
def test_the_command_line_says_it_in_one_line_and_exits_2(hub, tmp_path, capsys, argv):
    from attnchat import cli

    hub.add_repo(REPO, {"../../../../outside/pwned-x-Q4_K_M.gguf": DATA})
    status = cli.main(argv)
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.count("\n") == 1 and err.startswith("attnchat: error: "), err
    assert "'../../../../outside/pwned-x-Q4_K_M.gguf'" in err
    assert not (tmp_path / "outside").exists() and everything(tmp_path / "models") == []
