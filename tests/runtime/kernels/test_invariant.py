"""runtime.kernels.invariant and the reproducible kernels: a row's product has the same bits
whatever rows come with it and whatever the thread count (issue 30, item 1)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels import choice as kernels
from runtime.kernels.choice import ONE_ROW_ALONE, REPRODUCIBLE, KernelChoice, reproducible_choice
from runtime.kernels.cpu import KERNELS, WeightRef, fbgemm_f16_available
from runtime.kernels.invariant import rows_invariant, rows_product, two_rows
from runtime.model.attention import attention_reference
from runtime.model.attention_rows import BLOCK, attention_rows
from runtime.quantize import quantize_int8

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
@pytest.mark.parametrize("dtype,name", [(d, n) for d, names in REPRODUCIBLE.items() for n in names])
def test_every_reproducible_kernel_is_row_invariant(dtype, name, shape):
    """One row, 2-257 rows, 1 and 2 threads: bitwise the same rows (the rule the reproducible
    mode stands on), and the product right."""
    if name == "fbgemm-f16" and not fbgemm_f16_available():
        pytest.skip("this torch has no FBGEMM")
    ref = _ref(dtype, *shape)
    choice = KernelChoice(name, name, reproducible=True)
    assert rows_invariant(lambda x: kernels.apply(choice, x, ref, None), shape[1], threads=(1, 2)) == []
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(1))
    w = ref.weight.float() if ref.scale is None else ref.weight.float() * ref.scale.unsqueeze(1)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.apply(choice, x, ref, None), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_the_check_catches_kernels_that_are_not():
    """The default choice's one-row kernels (a matrix-vector product; float16's also rounds
    its input) and MKL's products are not row-invariant: the check says so, which is why
    the reproducible mode does not use them."""
    ref32, ref16 = _ref(torch.float32, 96, 576), _ref(torch.float16, 96, 576)
    default16 = kernels.default_choice(torch.float16)
    assert rows_invariant(lambda x: kernels.apply(default16, x, ref16, None), 576)  # f16-gemv vs widen-onednn
    assert rows_invariant(lambda x: KERNELS["mkl"](x, ref32, None), 576)
    # oneDNN's one-row path is a matrix-vector kernel: only two rows at a time keep it in step
    assert rows_invariant(lambda x: KERNELS["onednn"](x, ref32, None), 576, rows=(2, 3, 64))
    assert "onednn" not in ONE_ROW_ALONE


def test_reproducible_choice_per_dtype():
    for dtype in REPRODUCIBLE:
        ref = _ref(dtype, 32, 64)
        c = reproducible_choice(dtype, ref, threads=(1, 2))
        assert c.reproducible and c.decode == c.prefill and c.prefill in REPRODUCIBLE[dtype]
    if fbgemm_f16_available():
        assert reproducible_choice(torch.float16).prefill == "fbgemm-f16"


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
