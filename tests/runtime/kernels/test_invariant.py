"""runtime.kernels.invariant and the reproducible kernels: a row's product has the same bits
whatever rows come with it and whatever the thread count."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels import choice as kernels
from runtime.kernels.choice import ONE_ROW_ALONE
from runtime.kernels.cpu import KERNELS, WeightRef, fbgemm_f16_available
from runtime.kernels.invariant import rows_invariant, rows_product, two_rows
from runtime.kernels.reproducible import REPRODUCIBLE, reproducible_choice
from runtime.model.attention import attention_reference
from runtime.model.attention_rows import BLOCK, attention_rows
from runtime.quantize import quantize_int8
from tests.hang import HANG_S, ROOT

#: The default model's matrix shapes, narrowed (speed) but with its row lengths: 576 (the
#: hidden size) and 1536 (the MLP's) along ``in``.
SHAPES = [(96, 576), (48, 1536)]


def _ref(dtype: torch.dtype, out: int, inp: int) -> WeightRef:
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out + inp)) / 20
    if dtype == torch.int8:
        codes, scale = quantize_int8(w)
        return WeightRef(codes, scale.squeeze(1))
    return WeightRef(w.to(dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(REPRODUCIBLE))
def test_the_kernel_the_mode_chooses_here_is_row_invariant(dtype, shape):
    """The kernel the reproducible mode chooses on this machine (after checking its
    candidates on the matrix): one row, 2-257 rows, 1 and 2 threads give bitwise the same
    rows (the rule the mode stands on), and the product is right."""
    ref = _ref(dtype, *shape)
    choice = reproducible_choice(dtype, [ref], threads=(1, 2))
    assert choice.reproducible and choice.prefill in REPRODUCIBLE[dtype]
    assert rows_invariant(lambda x: kernels.apply(choice, x, ref, None), shape[1], threads=(1, 2)) == []
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(1))
    w = ref.weight.float() if ref.scale is None else ref.weight.float() * ref.scale.unsqueeze(1)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.apply(choice, x, ref, None), F.linear(x, w), rtol=1e-4, atol=1e-4)


def _noisy(calls: list):
    """A kernel whose rows depend on the row count (as a GEMM whose blocking changes with M):
    float32 oneDNN plus 1e-6 per row beyond the first two."""
    def kernel(x, ref, b):
        calls.append(x.shape)
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        return KERNELS["onednn"](x, ref, b) + 1e-6 * max(0, rows - 2)
    return kernel


def test_the_mode_refuses_a_kernel_that_fails_the_check(monkeypatch):
    calls: list = []
    monkeypatch.setitem(KERNELS, "noisy", _noisy(calls))
    monkeypatch.setitem(REPRODUCIBLE, torch.float32, ("noisy", "onednn"))
    ref = _ref(torch.float32, *SHAPES[0])
    choice = reproducible_choice(torch.float32, [ref], threads=(1, 2))
    assert choice.prefill == "onednn" and calls
    assert choice.reason.startswith("onednn (row-invariant here); noisy: rows differ here (576 wide, ")
    monkeypatch.setitem(REPRODUCIBLE, torch.float32, ("noisy",))
    with pytest.raises(ValueError, match="no row-invariant kernel for float32 weights here: noisy: rows differ"):
        reproducible_choice(torch.float32, [ref], threads=(1, 2))


def test_the_verdicts_are_kept_per_machine(monkeypatch, tmp_path):
    """Checked once per machine and folder: a second load reads the verdicts (the noisy
    kernel is not run again); other thread counts or widths are checked anew."""
    calls: list = []
    monkeypatch.setitem(KERNELS, "noisy", _noisy(calls))
    monkeypatch.setitem(REPRODUCIBLE, torch.float32, ("noisy", "onednn"))
    refs = [_ref(torch.float32, *SHAPES[0]), _ref(torch.float32, *SHAPES[1])]
    first = reproducible_choice(torch.float32, refs, threads=(1, 2), folder=tmp_path)
    kept = json.loads(next(tmp_path.glob("kernels-*.json")).read_text())
    verdicts = kept["reproducible"]["float32"]
    assert verdicts["onednn"] == {"widths": [576, 1536], "threads": [1, 2], "failures": []}
    assert verdicts["noisy"]["failures"][0].startswith("576 wide, ")
    seen = len(calls)
    again = reproducible_choice(torch.float32, refs, threads=(1, 2), folder=tmp_path)
    assert (again.prefill, again.reason) == (first.prefill, first.reason) and len(calls) == seen
    reproducible_choice(torch.float32, refs, threads=(1,), folder=tmp_path)
    assert len(calls) > seen


def test_fbgemm_with_its_avx2_kernels_is_refused_or_passes_the_check():
    """FBGEMM's AVX2 float16 kernels (an AVX2-only CPU such as AMD Zen 3; forced here by
    FBGEMM_ENABLE_INSTRUCTIONS) are not row-invariant on the default model's widths: the mode
    then runs what passes, and that is row-invariant."""
    if not fbgemm_f16_available():
        pytest.skip("this torch has no FBGEMM")
    code = textwrap.dedent("""
        import json, torch
        from runtime.kernels import choice as kernels
        from runtime.kernels.cpu import WeightRef
        from runtime.kernels.invariant import rows_invariant
        from runtime.kernels.reproducible import reproducible_choice
        refs = [WeightRef((torch.randn(96, n, generator=torch.Generator().manual_seed(n)) / 20).half())
                for n in (576, 1536)]
        c = reproducible_choice(torch.float16, refs, threads=(1, 2))
        bad = [f for r in refs for f in rows_invariant(lambda x: kernels.apply(c, x, r, None), r.weight.shape[1],
                                                         threads=(1, 2))]
        print(json.dumps({"kernel": c.prefill, "reason": c.reason, "bad": bad}))
    """)
    env = dict(os.environ, FBGEMM_ENABLE_INSTRUCTIONS="AVX2")
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["bad"] == []
    assert got["kernel"] == "widen-onednn" and "fbgemm-f16: rows differ here (576 wide, " in got["reason"]


def test_two_rows_keeps_shapes():
    seen = []
    fn = lambda x2: seen.append(x2.shape) or x2 * 2  # noqa: E731
    x = torch.randn(1, 1, 8)
    assert torch.equal(two_rows(fn, x), x * 2) and seen == [(2, 8)]
    y = torch.randn(2, 3, 8)
    assert torch.equal(two_rows(fn, y), y * 2) and seen[-1] == (6, 8)


@pytest.mark.parametrize("op", [torch.exp, torch.tanh, torch.erf])
def test_elementwise_ops_the_reproducible_path_uses_give_tails_the_same_bits(op):
    """exp, tanh and erf compute a thread's last few elements with the same vector code as the
    rest (so an element's bits do not depend on where a split falls); torch's fused SiLU does
    not, which is why the reproducible MLP composes its activation."""
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(3)) * 4
    whole = op(x)
    n = 7 * 1000
    pieces = torch.cat([op(x[i : i + 7].clone()) for i in range(0, n, 7)])
    assert torch.equal(pieces, whole[:n])
    silu = torch.cat([F.silu(x[i : i + 7].clone()) for i in range(0, n, 7)])
    assert not torch.equal(silu, F.silu(x)[:n])


# ---- attention ----------------------------------------------------------------------------------
def _qkv(T: int, H: int = 6, Hkv: int = 2, D: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g),
            torch.randn(1, Hkv, T, D, generator=g))


@pytest.mark.parametrize("window,softcap,heads", [(None, None, (6, 2)), (None, None, (4, 4)), (40, None, (6, 2)),
                                                  (None, 2.0, (4, 1))])
def test_attention_rows_equals_the_formula(window, softcap, heads):
    q, k, v = _qkv(BLOCK + 37, *heads)
    want, _ = attention_reference(q, k, v, window=window, softcap=softcap)
    got = attention_rows(q, k, v, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_attention_rows_gives_a_query_the_same_bits_in_any_chunk(window):
    """A query's output in one prefill, in a chunk after cached keys and alone (a decode
    step), at 1 and 2 threads; a sliding layer's cache holding fewer old slots too."""
    T = BLOCK + 70
    q, k, v = _qkv(T)
    whole = attention_rows(q, k, v, window=window)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for p in (0, 1, 63, BLOCK - 1, BLOCK, T - 1):
                for chunk in (1, 2, 17, BLOCK + 1):
                    s = max(0, p + 1 - chunk)
                    # a sliding layer keeps its window and a little more: slot 0 is at ``first``
                    first = max(0, s - window - 5) if window else 0
                    got = attention_rows(q[:, :, s : p + 1], k[:, :, first : p + 1], v[:, :, first : p + 1],
                                         first=first, window=window)
                    assert torch.equal(got, whole[:, :, s : p + 1]), (threads, p, chunk)
    finally:
        torch.set_num_threads(before)


def test_rows_product_pads_one_row():
    w = torch.randn(40, 64)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.equal(rows_product(x[:1], w), rows_product(x, w)[:1])
