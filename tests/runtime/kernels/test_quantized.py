"""The quantized linear kernels (runtime.kernels.quantized) against a dequantized float64
reference, on every block type of a tiny generated GGUF; ggml's when ggml-python loads."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import ggml_ops
from runtime.kernels.quantized import QUANT_KERNELS, candidates, lookup, quant_linear, widen
from runtime.weights.gguf.mmap import read_gguf_tensors
from runtime.weights.quant_types import BLOCK_TYPES, block_type, dequantize, tinygemm_operands
from runtime.weights.quant_weight import QuantWeight
from tests.runtime.tiny_gguf import EVERY_TYPE, make_tiny_gguf

needs_ggml = pytest.mark.skipif(not ggml_ops.available(), reason="ggml-python not installed")

#: Relative error bounds against float64 on the same dequantized weights, from measured
#: errors on the real models' matrices and these tiny ones (Intel Xeon): ggml
#: quantizes activations per block of 32 (0.3-0.9 %); int4pack rounds them and the
#: scales to bfloat16 (0.3 %); int8pack requantizes the weights per row (0.8-1.4 %);
#: f16 rounds activations and weights to float16 (0.04 %); widen is float32 (1e-7); widen-bf16
#: rounds activations, weights and results to bfloat16 (0.3-0.4 %); ggml-exact
#: leaves ggml about 1/200 of its rounding (0.0024 % on the default model's Q8_0 head, 0.02-0.05 %
#: on its Q4_1 layers: their Q8_1 activations are not rebuilt bit for bit).
BOUNDS = {"ggml": 0.02, "ggml-exact": 2e-3, "ggml-head": 0.02, "int4pack-bf16": 0.01, "int4pack-f16": 2e-3, "int8pack": 0.03, "f16": 2e-3, "widen": 1e-5,
          "widen-bf16": 0.01}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("gguf"), overrides=EVERY_TYPE, embed_type="Q4_K")
    g = read_gguf_tensors(path)
    out = {}
    for name, info in g.tensors.items():
        if len(info.shape) == 2 and name.startswith(("blk.0.", "token_embd")):
            w = QuantWeight(g.raw(name), block_type(info.ggml_type), *info.shape)
            out[w.btype.name] = w
    assert set(out) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    return out


def _check(w: QuantWeight, kernel: str, rows: int):
    x = torch.randn(rows, w.cols, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ dequantize(w.raw, w.btype).double().T
    y = quant_linear(x, w, kernel)
    assert y.dtype == torch.float32 and y.shape == (rows, w.rows)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < BOUNDS[kernel], f"{kernel} on {w.btype.name}: relative error {err:.4f}"


@pytest.mark.parametrize("kernel", [k for k in QUANT_KERNELS if "cpu" in QUANT_KERNELS[k].devices])
@pytest.mark.parametrize("rows", [1, 5])
def test_kernels_equal_the_dequantized_product(weights, kernel, rows):
    if not QUANT_KERNELS[kernel].available():
        pytest.skip(f"{kernel} unavailable here")
    took = 0
    for name, w in weights.items():
        if QUANT_KERNELS[kernel].takes(w.btype):
            _check(w, kernel, rows)
            took += 1
    assert took >= (3 if kernel.startswith("int4pack") else 8)


def test_bias_and_batch_shapes(weights):
    w = weights["Q4_K"]
    x = torch.randn(2, 3, w.cols)
    b = torch.randn(w.rows)
    y = quant_linear(x, w, "widen", bias=b)
    torch.testing.assert_close(y, x @ dequantize(w.raw, w.btype).T + b, rtol=1e-5, atol=1e-5)


def test_candidates_per_type_and_device(weights):
    cpu4 = candidates(BLOCK_TYPES["Q4_K"], "cpu")
    assert "int4pack-bf16" in cpu4 and "int4pack-cuda" not in cpu4
    assert "int4pack-bf16" not in candidates(BLOCK_TYPES["Q5_0"], "cpu")
    assert candidates(BLOCK_TYPES["Q4_0"], "cuda")[0] == "int4pack-cuda"
    assert "int4pack-cuda" not in candidates(BLOCK_TYPES["Q8_0"], "cuda")
    assert ("ggml" in cpu4) == ggml_ops.available()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_tinygemm_operands_decode_to_the_weights(weights, name):
    """The CUDA kernel's operands, unpacked by hand on the CPU: codes two to a byte (even
    column high), ``w = (q - 8) * scale + zero`` with bfloat16 scales and zeros."""
    w = weights[name]
    pairs, sz = tinygemm_operands(w.raw, w.btype)
    assert pairs.dtype == torch.uint8 and pairs.shape == (w.rows, w.cols // 2)
    assert sz.dtype == torch.bfloat16 and sz.shape == (w.cols // 32, w.rows, 2)
    q = torch.stack([pairs >> 4, pairs & 0x0F], dim=-1).reshape(w.rows, w.cols).float()
    scale, zero = sz[..., 0].float().T, sz[..., 1].float().T  # (rows, groups)
    back = ((q - 8).view(w.rows, -1, 32) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(w.rows, w.cols)
    ref = dequantize(w.raw, w.btype)
    assert ((back - ref).norm() / ref.norm()).item() < 5e-3  # bfloat16 scales and zeros: 2^-9 each


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_tinygemm_on_cuda(weights, name):
    w = weights[name]
    x = torch.randn(1, w.cols)
    ref = x.double() @ dequantize(w.raw, w.btype).double().T
    y = quant_linear(x.cuda(), w, "int4pack-cuda", device="cuda").cpu().double()
    assert ((y - ref).norm() / ref.norm()).item() < 0.01


@pytest.mark.parametrize("kernel", ["f16", "widen"])
def test_device_branches_on_the_cpu(weights, kernel, monkeypatch):
    """What a GPU runs (``torch_ops``: torch's own products, no oneDNN, no scratch buffer) on
    CPU tensors: several rows, the widening a block of 3 rows at a time (plus a remainder)."""
    from runtime.kernels import quantized

    for name, w in weights.items():  # 128 to 512 rows: each ends with a shorter block
        x = torch.randn(5, w.cols, generator=torch.Generator().manual_seed(5))
        monkeypatch.setattr(quantized, "SCRATCH_ELEMENTS", 3 * w.cols)
        cpu = quant_linear(x, w, kernel)
        monkeypatch.setattr(quantized, "torch_ops", True)
        dev = quant_linear(x, w, kernel)
        monkeypatch.setattr(quantized, "torch_ops", False)
        ref = x.double() @ dequantize(w.raw, w.btype).double().T
        assert ((dev.double() - ref).norm() / ref.norm()).item() < BOUNDS[kernel], name
        if kernel == "f16":  # float16 activations and products, as on the GPU
            W16 = quantized.prepared(w, "f16")
            torch.testing.assert_close(dev, torch.nn.functional.linear(x.half(), W16).float(), rtol=0, atol=0)
            torch.testing.assert_close(dev, cpu, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
        else:  # both float32 products of the same widened rows
            torch.testing.assert_close(dev, cpu, rtol=1e-5, atol=1e-5)


def test_embedding_lookup_dequantizes_only_its_rows(weights):
    w = weights["Q6_K"]
    ids = torch.tensor([[3, 0, 3], [7, 1, 2]])
    rows = lookup(w, ids)
    assert rows.shape == (2, 3, w.cols)
    torch.testing.assert_close(rows, dequantize(w.raw, w.btype)[ids], rtol=0, atol=0)


@needs_ggml
@pytest.mark.parametrize("name", [n for n, t in BLOCK_TYPES.items() if t.linear_codes or not t.quantized])
def test_ggml_to_float_is_bitwise_gguf(name):  # the other types: tests/runtime/weights/test_ggml_types.py
    import numpy as np

    from runtime.weights.quant_make import quantize

    t = BLOCK_TYPES[name]
    w = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    raw = torch.from_numpy(quantize(w, t))
    out = dequantize(raw, t)
    if t.quantized:
        out = ggml_ops.to_float(raw, t.ggml_type, torch.empty(4, 512))
        torch.testing.assert_close(out, dequantize(raw, t), rtol=0, atol=0)
    torch.testing.assert_close(widen(QuantWeight(raw, t, 4, 512)), out, rtol=0, atol=0)


@needs_ggml
def test_ggml_follows_torch_thread_count(weights):
    w = weights["Q8_0"]
    x = torch.randn(4, w.cols)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(quant_linear(x, w, "ggml"))
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # rows split, same sums
    finally:
        torch.set_num_threads(before)


def test_kernel_pairs_share_one_form_and_fall_back_without_ggml(monkeypatch, caplog):
    from runtime.kernels import quant_choice

    q4k, q8 = BLOCK_TYPES["Q4_K"], BLOCK_TYPES["Q8_0"]
    if ggml_ops.available():
        assert quant_choice.kernel_pairs(q8, "cpu")[0] == ("ggml", "widen")
    monkeypatch.setitem(ggml_ops._STATE, "why", "test")
    monkeypatch.delitem(ggml_ops._STATE, "ggml", raising=False)
    monkeypatch.setattr(quant_choice, "_SAID", set())
    assert not ggml_ops.available()
    with caplog.at_level("WARNING", logger=quant_choice.__name__):
        assert quant_choice.kernel_pairs(q4k, "cpu") == [("int4pack-bf16", "int4pack-bf16")]
        assert quant_choice.kernel_pairs(q8, "cpu") == [("f16", "f16")]
        assert quant_choice.kernel_pairs(q8, "cpu") == [("f16", "f16")]
    # the fallback is said once, however many matrices ask
    said = [r.getMessage() for r in caplog.records if r.name == quant_choice.__name__]
    assert len(said) == 1 and said[0].startswith("ggml-python is not installed"), said
    assert quant_choice.kernel_pairs(q4k, "cuda") == [("int4pack-cuda", "int4pack-cuda")]
    assert quant_choice.kernel_pairs(q8, "cuda") == [("f16", "f16")]
    for d, p in quant_choice.kernel_pairs(q4k, "cpu") + quant_choice.kernel_pairs(q8, "cpu"):
        assert QUANT_KERNELS[d].available() and QUANT_KERNELS[p].available()


def test_widen_without_ggml_is_torch_decoding(weights, monkeypatch):
    w = weights["Q5_K"]
    ref, rows = widen(w), lookup(w, torch.tensor([5, 0]))
    monkeypatch.setitem(ggml_ops._STATE, "why", "test")
    monkeypatch.delitem(ggml_ops._STATE, "ggml", raising=False)
    torch.testing.assert_close(widen(w), ref, rtol=0, atol=0)
    torch.testing.assert_close(lookup(w, torch.tensor([5, 0])), rows, rtol=0, atol=0)


def test_measure_keeps_one_pair_per_type(weights):
    from runtime.kernels.quant_choice import SHORT_KERNEL, kernel_pairs, measure_quant

    ws = list(weights.values())
    choice = measure_quant(ws, reps=1, prefill_rows=4)
    assert set(choice.kernels) == {w.btype.name for w in ws}
    for name, pair in choice.kernels.items():
        assert pair in kernel_pairs(BLOCK_TYPES[name], "cpu")
    for w in ws:  # the losers' forms are dropped (the short prefills' kernel is no loser where it runs)
        short = {SHORT_KERNEL} if choice.short_rows.get(w.btype.name) else set()
        assert set(w.prepared) <= set(choice.kernels[w.btype.name]) | short


@needs_ggml
def test_a_fixed_decode_kernel_chooses_only_prefill(weights, tmp_path, monkeypatch):
    """The ggml decode step multiplies the blocks through ggml: the choice keeps its decode kernel,
    times prefill only (a repack beside the blocks only when it prefills 10 % faster), and is
    kept in its own section of the kept file."""
    import json

    from runtime.kernels import machine
    from runtime.kernels.chooser import load_or_measure
    from runtime.kernels.quant_choice import COPY_FREE, BlockKernels, measure_quant

    ws = list(weights.values())
    choice = measure_quant(ws, reps=1, prefill_rows=4, decode="ggml")
    assert {d for d, _ in choice.kernels.values()} == {"ggml"}
    for w in ws:
        name = w.btype.name
        _, prefill = choice.kernels[name]
        us = choice.timings_us[name]["prefill"]
        assert not choice.timings_us[name]["decode"]   # decode is not timed: it is fixed
        if prefill == "int4pack-bf16":   # a repack beside the blocks only when 10 % faster
            assert us[prefill] <= 0.9 * min(t for k, t in us.items() if k in COPY_FREE)
            assert w.extra_bytes > 0
        else:
            assert prefill in COPY_FREE and w.extra_bytes == 0
    monkeypatch.setattr(machine, "busy", lambda: False)
    btypes = {w.btype for w in ws}
    kept = load_or_measure(tmp_path, BlockKernels(btypes, "cpu", lambda: choice, decode="ggml"))
    assert kept.kernels == choice.kernels
    saved = json.loads(next(tmp_path.glob("kernels-*.json")).read_text())
    assert set(saved) == {"quant-decode-ggml"}
    again = load_or_measure(tmp_path, BlockKernels(btypes, "cpu", lambda: pytest.fail("measured again"), decode="ggml"))
    assert again.kernels == choice.kernels


def test_compiled_op_equals_eager(weights):
    from runtime.kernels.quantized import compiled_linear, weight_key

    w = weights["Q4_K"]
    op, key = compiled_linear(), weight_key(w)
    assert weight_key(w) == key

    def f(x):
        return torch.relu(op(x * 2, key, "widen")) + 1

    x = torch.randn(1, 1, w.cols)
    with torch.inference_mode():
        torch.testing.assert_close(torch.compile(f, fullgraph=True, dynamic=False)(x), f(x), rtol=0, atol=0)


@needs_ggml
def test_widening_and_lookup_device_branches_on_the_cpu(weights, monkeypatch):
    """Off the CPU (``torch_ops`` on CPU tensors) widening and row lookup decode with torch ops,
    not ggml: bitwise the same numbers."""
    from runtime.kernels import quantized

    ids = torch.tensor([[0, 3], [5, 1]])
    for name, w in weights.items():
        host = quantized.widen(w), quantized.lookup(w, ids)
        monkeypatch.setattr(quantized, "torch_ops", True)
        calls = []
        monkeypatch.setattr(ggml_ops, "to_float", lambda *a: calls.append(a))
        device = quantized.widen(w), quantized.lookup(w, ids)
        monkeypatch.undo()
        assert not calls, name   # no ggml on the device branch
        for a, b in zip(host, device):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


@needs_ggml
def test_the_head_kernel_gives_the_top_logits_without_ggmls_rounding(tmp_path):
    """On a head of 4,096 rows (more than HEAD_EXACT_TOP), ggml-head's largest logits are the
    float64 product's to float32 rounding, where plain ggml is off by its activation rounding;
    the other logits are plain ggml's."""
    from runtime.kernels.quantized import HEAD_EXACT_TOP, quant_linear
    from runtime.weights.quant_types import BLOCK_TYPES
    from runtime.weights.quant_weight import QuantWeight

    torch.manual_seed(0)
    rows, cols = 4096, 256
    dense = torch.randn(rows, cols) * 0.05
    import gguf.quants

    raw = torch.from_numpy(gguf.quants.quantize(dense.numpy(), gguf.GGMLQuantizationType.Q8_0)).contiguous()
    w = QuantWeight(raw, BLOCK_TYPES["Q8_0"], rows, cols)
    x = torch.randn(2, cols) * 3
    ref = x.double() @ w.dequantized(torch.float32).double().T
    plain = quant_linear(x, w, "ggml")
    head = quant_linear(x, w, "ggml-head")
    top = plain.topk(HEAD_EXACT_TOP, dim=-1).indices
    for i in range(2):
        t = top[i]
        exact = (head[i, t].double() - ref[i, t]).abs().max().item()
        rounded = (plain[i, t].double() - ref[i, t]).abs().max().item()
        assert exact < 1e-4 * ref[i].abs().max().item() and exact < rounded / 50, (exact, rounded)
        others = torch.ones(rows, dtype=torch.bool)
        others[t] = False
        assert torch.equal(head[i, others], plain[i, others])
        assert int(head[i].argmax()) == int(ref[i].argmax())
    x4 = torch.cat([x, torch.randn(2, cols) * 3])   # rows batched together equal each row alone
    together = quant_linear(x4, w, "ggml-head")
    for i in range(4):
        assert torch.equal(together[i], quant_linear(x4[i : i + 1], w, "ggml-head")[0]), i


@needs_ggml
def test_the_bfloat16_prefill_is_offered_only_where_onednn_multiplies_bfloat16(monkeypatch):
    """An AMD Zen 3 (AVX2, no AVX512-BF16) has no oneDNN bfloat16 product: there the pair is not
    offered; where it runs, it is offered for every quantized type, never for a float matrix."""
    from runtime.kernels import onednn, quant_choice

    q4, f32 = BLOCK_TYPES["Q4_1"], BLOCK_TYPES["F32"]
    monkeypatch.setattr(onednn, "takes_bfloat16", lambda: False)
    assert ("ggml", "widen-bf16") not in quant_choice.kernel_pairs(q4, "cpu")
    monkeypatch.setattr(onednn, "takes_bfloat16", lambda: True)
    assert ("ggml", "widen-bf16") in quant_choice.kernel_pairs(q4, "cpu")
    assert all("widen-bf16" not in pair for pair in quant_choice.kernel_pairs(f32, "cpu"))
    assert quant_choice.kernel_pairs(q4, "cpu")[0] == ("ggml", "widen")   # the unmeasured default stays float32


@needs_ggml
def test_short_prefills_are_timed_and_kept(weights, tmp_path, monkeypatch):
    """Where the short kernel multiplies a few rows faster than the type's prefill kernel, the
    choice says up to how many rows: every count timed up to it was faster, the next was not
    (or was the last timed). The rows are kept with the pair, and a kept file without them is
    measured again."""
    import json

    from runtime.kernels import machine
    from runtime.kernels.chooser import load_or_measure
    from runtime.kernels.quant_choice import SHORT_KERNEL, SHORT_ROWS, BlockKernels, measure_quant

    ws = list(weights.values())
    choice = measure_quant(ws, reps=1, prefill_rows=64, decode="ggml")
    for w in ws:
        name = w.btype.name
        _, prefill = choice.kernels[name]
        n = choice.short_rows.get(name, 0)
        if prefill == SHORT_KERNEL:
            assert n == 0
            continue
        timed = choice.timings_us[name]["short"]
        faster = [int(r) for r, us in timed.items() if us[SHORT_KERNEL] < us[prefill]]
        assert n in (0, *SHORT_ROWS)
        assert faster[: len([r for r in SHORT_ROWS if r <= n])] == [r for r in SHORT_ROWS if r <= n]
        if n and n != SHORT_ROWS[-1]:
            nxt = SHORT_ROWS[SHORT_ROWS.index(n) + 1]
            assert timed[str(nxt)][SHORT_KERNEL] >= timed[str(nxt)][prefill]
        if n:
            assert choice.kernel(w.btype, n) == SHORT_KERNEL and choice.kernel(w.btype, n + 1) == prefill
            assert SHORT_KERNEL in w.prepared
        assert choice.kernel(w.btype, 1) == "ggml"
    monkeypatch.setattr(machine, "busy", lambda: False)
    btypes = {w.btype for w in ws}
    kept = load_or_measure(tmp_path, BlockKernels(btypes, "cpu", lambda: choice, decode="ggml"))
    assert kept.short_rows == choice.short_rows
    again = load_or_measure(tmp_path, BlockKernels(btypes, "cpu", lambda: pytest.fail("measured again"), decode="ggml"))
    assert again.short_rows == {n: choice.short_rows.get(n, 0) for n in choice.kernels}
    path = next(tmp_path.glob("kernels-*.json"))
    saved = json.loads(path.read_text())
    for entry in saved["quant-decode-ggml"].values():
        del entry["short_rows"]   # a file kept before short prefills were timed
    path.write_text(json.dumps(saved))
    calls = []
    load_or_measure(tmp_path, BlockKernels(btypes, "cpu", lambda: calls.append(1) or choice, decode="ggml"))
    assert calls == [1]


@needs_ggml
def test_a_layer_runs_the_short_kernel_up_to_its_rows(weights):
    """A product of at most ``short_rows`` rows is the short kernel's, bit for bit; one more row
    is the prefill kernel's; one row is decode's."""
    from runtime.kernels.quant_choice import SHORT_KERNEL, QuantChoice
    from runtime.model.quant_layers import QuantLinear

    w = weights["Q4_K"]
    layer = QuantLinear([w])
    layer.set_choice(QuantChoice({"Q4_K": ("ggml", "widen")}, short_rows={"Q4_K": 8}))
    g = torch.Generator().manual_seed(0)
    for rows, kernel in ((1, "ggml"), (2, SHORT_KERNEL), (8, SHORT_KERNEL), (9, "widen"), (32, "widen")):
        x = torch.randn(rows, w.cols, generator=g)
        torch.testing.assert_close(layer(x), quant_linear(x, w, kernel), rtol=0, atol=0, msg=f"{rows} rows")
    x = torch.randn(8, w.cols, generator=g)
    assert not torch.equal(quant_linear(x, w, SHORT_KERNEL), quant_linear(x, w, "widen"))   # the test can tell them apart


@pytest.mark.parametrize("V", [1000, 49152, 262144 + 77])
def test_top_indices_are_topks(V):
    """The LM head's top logits through chunk maxima first: the same indices as ``topk`` on
    distinct values (several rows, a length that is no whole number of chunks), the same values
    where rows hold ties, and the largest in a chunk's tail found too."""
    from runtime.kernels.quantized import top_indices

    g = torch.Generator().manual_seed(V)
    y = torch.randn(3, V, generator=g) * 4
    y[1, -1] = 100.0   # in the last, partial chunk
    assert torch.equal(top_indices(y, 128), y.topk(128, dim=-1).indices)
    ties = torch.zeros(2, V)
    ties[:, ::7] = 1.0
    got = top_indices(ties, 128)
    assert torch.equal(ties.gather(1, got), ties.topk(128, dim=-1).values)
