"""models.hub against the stand-in Hub: who may download (gated repositories, tokens) and when
the Hub is not there (offline mode, no network)."""
from __future__ import annotations

import logging
import os
import socket

import pytest

import models
from models.errors import HubError
from models.hub import api
from tests.models.hub.repos import REPO, fetch_error, only_files, tiny_repo

SECRET = "hf_standin_secret_token_0123456789"


def test_gated_repo_without_a_token_says_how_to_get_access(hub):
    tiny_repo(hub, gated="manual")
    err = fetch_error(f"hf.co/{REPO}:Q4_K_M")
    assert err.kind == "gated"
    assert str(err) == (f"fetching hf.co/{REPO}/Tiny-Instruct-Q4_K_M.gguf: hf.co/{REPO} is gated: accept its terms at "
                        f"{hub.endpoint}/{REPO}, then log in with `hf auth login` (attnchat uses huggingface_hub's "
                        "saved token)")
    assert only_files(models.models_dir()) == []


def test_gated_repo_with_a_token_not_granted_yet(hub, monkeypatch):
    tiny_repo(hub, gated="manual")
    monkeypatch.setenv("HF_TOKEN", SECRET)
    err = fetch_error(f"hf.co/{REPO}:Q4_K_M")
    assert err.kind == "gated" and "this Hugging Face account has no access yet" in str(err)


def test_gated_repo_with_the_users_token_downloads_and_never_shows_it(hub, monkeypatch, tmp_path, caplog, capfd):
    from huggingface_hub import constants

    repo = tiny_repo(hub, gated="auto")
    hub.granted.add(REPO)
    saved = tmp_path / "hf-home" / "token"   # where `hf auth login` saves it
    saved.parent.mkdir()
    saved.write_text(SECRET)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(saved))
    caplog.set_level(logging.DEBUG)
    path = models.hub.fetch_hub(f"hf.co/{REPO}:Q4_K_M")
    assert path.read_bytes() == repo.files["Tiny-Instruct-Q4_K_M.gguf"]
    # The token went to the Hub, never to the CDN, and appears in no log, output or file.
    assert all(r.has_token for r in hub.hits("hub"))
    assert not any(r.has_token for r in hub.hits("cdn"))
    out = capfd.readouterr()
    assert SECRET not in caplog.text and SECRET not in out.out + out.err
    assert all(SECRET.encode() not in p.read_bytes() for p in models.models_dir().rglob("*") if p.is_file())


def test_offline_mode_asks_nothing(hub, monkeypatch):
    tiny_repo(hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = fetch_error(f"hf.co/{REPO}:Q4_K_M")
    assert err.kind == "offline"
    assert str(err) == (f"listing hf.co/{REPO}: the Hugging Face Hub is switched off here (HF_HUB_OFFLINE is set); "
                        "unset it to search or download, or use a model you already have (`attnchat models list`, "
                        "`attnchat models import PATH`)")
    with pytest.raises(HubError, match="switched off here"):
        models.hub.search("tiny")
    assert hub.requests == []


def test_the_offline_switch_attnchat_sets_for_its_libraries_does_not_stop_the_hub(hub, monkeypatch):
    """The command line switches huggingface_hub/transformers offline for its own loading
    (models.hub.api.libraries_offline); an explicit search or download still goes out, and the
    switch is back on afterwards. A user's own HF_HUB_OFFLINE (test above) stops them."""
    from huggingface_hub import constants

    repo = tiny_repo(hub)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv(api.APP_OFFLINE_ENV, raising=False)
    api.libraries_offline()
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ[api.APP_OFFLINE_ENV] == "1"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)   # as read when huggingface_hub was imported
    assert [h.repo_id for h in models.hub.search("tiny")] == [REPO]
    path = models.hub.fetch_hub(f"hf.co/{REPO}:Q4_K_M")
    assert path.read_bytes() == repo.files["Tiny-Instruct-Q4_K_M.gguf"]
    assert constants.HF_HUB_OFFLINE is True
    # A user who set it before attnchat started keeps it.
    monkeypatch.delenv(api.APP_OFFLINE_ENV)
    api.libraries_offline()
    assert api.APP_OFFLINE_ENV not in os.environ
    with pytest.raises(HubError, match="switched off here"):
        models.hub.search("tiny")


def test_no_network(hub, monkeypatch):
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    err = fetch_error(f"hf.co/{REPO}:Q4_K_M")
    assert err.kind == "offline"
    assert str(err) == (f"listing hf.co/{REPO}: cannot reach the Hugging Face Hub at http://127.0.0.1:{port} "
                        "(ConnectError); check the network connection, or use a model you already have "
                        "(`attnchat models list`, `attnchat models import PATH`)")
    with pytest.raises(HubError, match="cannot reach the Hugging Face Hub"):
        models.hub.search("tiny")
