"""The attention hooks list: one list for the capture, head edits and a cache's evictor."""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.cache.policies.evictor import Evictor
from runtime.model.decode_step import DecodeStep
from runtime.model.hooks import Hook
from tests.runtime.tiny_models import make_tiny_model

PROMPT = list(range(40, 52))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("hooks"), "llama"), device="cpu", dtype="float32")


def test_a_last_row_hook_and_a_full_hook_see_the_same_weights_in_one_pass(model):
    full, last = {}, {}
    hooks = model.decoder.hooks
    a = hooks.add(Hook("weights", lambda layer, w: full.setdefault(layer, w.clone())))
    b = hooks.add(Hook("weights", lambda layer, w: last.setdefault(layer, w.clone()), last_row_only=True))
    try:
        model.logits(PROMPT, model.new_cache(64))
    finally:
        hooks.remove(a)
        hooks.remove(b)
    T, L = len(PROMPT), model.config.n_layers
    assert sorted(full) == sorted(last) == list(range(L))
    assert full[0].shape == (1, model.config.n_heads, T, T) and last[0].shape == (1, model.config.n_heads, 1, T)
    torch.testing.assert_close(last[1], full[1][:, :, -1:])
    assert hooks.active == () and model.decoder.observer is None


def test_an_attached_evictor_joins_the_hooks_of_its_own_cache_only(model):
    mine, other = model.new_cache(64), model.new_cache(64)
    ev = Evictor("h2o", 8, step=4).attach(mine)
    assert [h.kind for h in model.decoder.hooks.for_cache(mine)] == ["queries"]
    assert model.decoder.hooks.for_cache(other) == () and model.decoder.hooks.for_cache(None) == ()
    step = DecodeStep(model.decoder, "static")
    assert step.static_ok(other) and not step.static_ok(mine)
    ev.detach(mine)
    assert step.static_ok(mine)


def test_a_head_edit_is_its_layers_hook_only(model):
    attn = model.decoder.blocks[1].attn
    edit = lambda layer, y: y * 0  # noqa: E731
    attn.head_edit = edit
    assert attn.head_edit is edit and model.decoder.blocks[0].attn.head_edit is None
    assert [(h.kind, h.layer) for h in model.decoder.hooks.active] == [("heads", 1)]
    attn.head_edit = None
    assert model.decoder.hooks.active == ()


def test_an_unknown_hook_kind_is_refused():
    with pytest.raises(ValueError, match="unknown attention hook kind 'keys'"):
        Hook("keys", print)


def test_a_hook_runs_in_the_passes_of_the_thread_that_registered_it_only(model):
    """One model serves the desktop's chat (the worker thread) and the in-process server (its
    own threads): the chat's capture and knock-outs must not reach a server request's pass."""
    import threading

    seen: list[int] = []
    hooks = model.decoder.hooks
    hook = hooks.add(Hook("weights", lambda layer, w: seen.append(threading.get_ident())))
    attn = model.decoder.blocks[1].attn
    attn.head_edit = lambda layer, y: y * 0
    other: dict = {}

    def elsewhere() -> None:
        other["hooks"] = hooks.for_cache(None)
        other["edit"] = attn.head_edit
        other["static"] = DecodeStep(model.decoder, "static").static_ok(model.new_cache(64))
        other["logits"] = model.logits(PROMPT, model.new_cache(64))

    try:
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join(60)
        assert other["hooks"] == () and other["edit"] is None and other["static"]
        assert seen == []                      # the other thread's pass ran no hook of this one
        model.logits(PROMPT, model.new_cache(64))
        assert set(seen) == {threading.get_ident()}   # this thread's passes run them
    finally:
        hooks.remove(hook)
        attn.head_edit = None
    plain = model.logits(PROMPT, model.new_cache(64))
    torch.testing.assert_close(other["logits"], plain)   # nor was a head knocked out there
    assert hooks.active == ()
