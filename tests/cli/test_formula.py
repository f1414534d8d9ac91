"""``attnchat formula`` and runtime.insight.formula: the material's worked example to 3 decimals,
the same numbers as our attention, bad input in one line with exit 2."""
from __future__ import annotations

import json

import pytest
import torch

from attnchat.cli import main
from runtime.insight.formula import formula_by_hand
from runtime.model.attention import attention_reference

EXAMPLE = ["--q", "2,0", "--k", "0,1", "2,0", "1,1", "--v", "1,0", "0,1", "1,1"]


def _json(capsys, *args) -> dict:
    assert main(["formula", *EXAMPLE, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _r3(xs):
    return [round(x, 3) for x in xs]


def test_the_cat_sat(capsys):
    d = _json(capsys)
    assert _r3(d["scores"]) == [0, 4, 2]
    assert _r3(d["scaled"]) == [0, 2.828, 1.414]
    assert _r3(d["weights"]) == [0.045, 0.768, 0.187]
    assert _r3(d["output"]) == [0.232, 0.955]


def test_without_scaling(capsys):
    d = _json(capsys, "--no-scale")
    assert _r3(d["scaled"]) == [0, 4, 2]
    assert _r3(d["weights"]) == [0.016, 0.867, 0.117]


def test_causal_mask_for_the_query_at_cat(capsys):
    assert main(["formula", "--q", "0,1", "--k", "0,1", "2,0", "1,1", "--v", "1,0", "0,1", "1,1",
                 "--causal-at", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert _r3(d["weights"]) == [0.67, 0.33, 0.0]
    assert d["weights"][2] == 0.0 and d["masked"] == [False, False, True]


def test_text_output_and_defaults(capsys):
    assert main(["formula"]) == 0  # the defaults are the worked example
    out = capsys.readouterr().out.splitlines()
    assert out[0] == 'q = (2.000, 0.000) (the query of "sat" in the worked example "the cat sat"), d_k = 2, scale = 0.707'
    assert [line.split()[0] for line in out[1:5]] == ["key", "the", "cat", "sat"]
    assert out[3].split()[-1] == "0.768" and out[-1] == "output = (0.232, 0.955)"
    assert main(["formula", "--k", "1,0", "0,1", "--v", "1,0", "0,1"]) == 0  # not the example: rows by index
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("q = (2.000, 0.000), d_k = 2") and [line.split()[0] for line in out[2:4]] == ["0", "1"]


def test_same_numbers_as_our_attention():
    g = torch.Generator().manual_seed(0)
    q, K, V = torch.randn(8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    r = formula_by_hand(q.tolist(), K.tolist(), V.tolist(), causal_at=3)
    out, w = attention_reference(q.view(1, 1, 1, 8), K[:4].view(1, 1, 4, 8), V[:4].view(1, 1, 4, 8))
    torch.testing.assert_close(torch.tensor(r.weights[:4], dtype=torch.float64), w[0, 0, 0].double(), rtol=1e-5, atol=1e-7)
    assert r.weights[4] == 0.0
    torch.testing.assert_close(torch.tensor(r.output, dtype=torch.float64), out[0, 0, 0].double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args, words", [
    (["--q", "2,x"], ["--q", "'2,x'", "numbers separated by commas"]),
    (["--k", "0,1,2"], ["every key", "2 numbers"]),
    (["--v", "1,0"], ["one value per key"]),
    (["--causal-at", "3"], ["position 3", "0..2"]),
    (["--q", "nan,1"], ["not finite"]),
])
def test_bad_input_one_line_exit_2(capsys, args, words):
    assert main(["formula", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnchat: error:") and "Traceback" not in err
    for w in words:
        assert w in err
