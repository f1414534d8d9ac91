"""``attnchat bench --profile``'s profile (attnchat.bench.profile) on a tiny GGUF: every part
timed, the parts adding up to the step, the eager step's operations counted by kind."""
from __future__ import annotations

import pytest

from runtime import load_model
from runtime.kernels import ggml_ops
from tests.runtime.tiny_gguf import EVERY_TYPE, make_tiny_gguf, tiny_tokenizer_metadata


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile")
    path = make_tiny_gguf(folder, tokenizer=tiny_tokenizer_metadata(), overrides=EVERY_TYPE, embed_type="Q8_0")
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNCHAT_CACHE_DIR", str(folder / "cache"))
    try:
        yield load_model(path, device="cpu", threads=1)
    finally:
        mp.undo()


def test_the_profile_times_every_part(model):
    from attnchat.bench.profile import KINDS, profile

    p = profile(model, depth=64, tokens=6)
    assert p["depth"] == 64 and p["step_ms"] > 0
    if ggml_ops.available():
        assert p["decode_mode"] == "ggml"
        parts = p["step_parts_ms"]
        # a float cache: the whole token is one graph, its attention and cache writes in it
        assert set(parts) == {"graphs", "head", "other"}
        assert all(v >= 0 for v in parts.values()) and parts["graphs"] > 0 and parts["head"] > 0
        # each part a median over the tokens, inside the step (the call around it, the thread
        # governor's, is not a part): together not more than a step
        assert sum(parts.values()) < 2 * p["step_ms"]
        assert model._step._ggml.timings is None  # the timers are off again
    e = p["eager"]
    # the tiny file's 2 layers: dozens of operations a layer, each counted
    assert 40 < e["aten_calls_per_token"] < 2000
    assert set(e["aten_ms_by_kind"]) <= set(KINDS) | {"views, copies, casts"}
    assert e["aten_ms_by_kind"]["attention"] > 0 and e["step_ms"] > 0
    assert set(p["prefill_ms_per_token"]) == {"16", "64", "256"}  # 512 is past the tiny model's context
    assert all(v > 0 for v in p["prefill_ms_per_token"].values())


def test_a_model_that_cannot_load_is_the_workers_one_line_not_a_traceback(tmp_path, capsys):
    """The worker says a model it cannot load in one line and exits with USER_ERROR, which
    ``attnchat bench`` turns into the user's error (before: a traceback, then 'internal error')."""
    from attnchat.bench import worker

    missing = tmp_path / "gone.gguf"
    assert worker.main(["--engine", "ours", "--model", str(missing)]) == worker.USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gone.gguf" in err[0] and "Traceback" not in err[0]
