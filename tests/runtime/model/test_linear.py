"""runtime.model.layers.linear: oneDNN's inner product on the CPU, F.linear elsewhere."""
import pytest
import torch
import torch.nn.functional as F

from runtime.kernels import cpu as cpu_kernels
from runtime.kernels import onednn
from runtime.model.layers import Linear, linear

needs_onednn = pytest.mark.skipif(onednn.linear_op() is None, reason="torch build without oneDNN linear")


@pytest.mark.parametrize("shape", [(1, 1, 48), (2, 7, 48), (5, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_float32(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(80, 48, generator=g)
    b = torch.randn(80, generator=g) if bias else None
    with torch.inference_mode():
        out = linear(x, w, b)
    assert out.shape == (*shape[:-1], 80)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_non_contiguous_input():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 100, generator=g)[..., 10:58]
    w = torch.randn(16, 48, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_bfloat16_close_to_float32():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, 64, generator=g)
    w = torch.randn(32, 64, generator=g) / 8
    with torch.inference_mode():
        out = linear(x.bfloat16(), w.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, w), rtol=0.05, atol=0.05)


def test_gradients_still_flow():
    """Outside inference mode, with a weight that wants gradients, F.linear does the work."""
    layer = Linear(8, 4)
    x = torch.randn(2, 8)
    layer(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(4, 8))


@needs_onednn
def test_cpu_float32_takes_the_onednn_kernel(monkeypatch):
    calls = []
    real = onednn.linear_op()

    def spy(*args):
        calls.append(args[1].shape)
        return real(*args)

    monkeypatch.setattr(onednn, "_OPS", {torch.float32: spy})
    with torch.inference_mode():
        linear(torch.randn(1, 6), torch.randn(3, 6))
        linear(torch.randn(1, 6).double(), torch.randn(3, 6).double())  # float64: F.linear
    assert calls == [torch.Size([3, 6])]


@pytest.mark.parametrize("rows", [1, 5])
def test_float16_weight_with_float32_input(rows):
    """float16 weights compute in float32 on the CPU: one row through the float16 kernel
    (input rounded to float16), several rows with the weight widened to float32."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, rows, 64, generator=g)
    w = (torch.randn(32, 64, generator=g) / 8).half()
    b = torch.randn(32, generator=g)
    exact = F.linear(x, w.float(), b)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            out = linear(x, w, b)
            again = linear(x, w, b)  # the scratch buffer is reused
        assert out.dtype == torch.float32 and out.shape == (1, rows, 32)
        tol = 2e-2 if rows == 1 else 1e-5
        torch.testing.assert_close(out, exact, rtol=tol, atol=tol)
        torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_widened_weights_of_different_shapes_do_not_mix():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 16, generator=g)
    big, small = torch.randn(40, 16, generator=g).half(), torch.randn(8, 16, generator=g).half()
    other = torch.randn(40, 16, generator=g).half()  # same shape as big: same scratch address
    with torch.inference_mode():
        a, b, c, a2 = linear(x, big), linear(x, small), linear(x, other), linear(x, big)
    torch.testing.assert_close(a, F.linear(x, big.float()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, F.linear(x, small.float()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c, F.linear(x, other.float()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a2, a, rtol=0, atol=0)


@pytest.mark.parametrize("wdtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_accelerator_path_rounds_the_input_for_every_row_count(monkeypatch, wdtype, rows):
    """The GPU/MPS path (runtime.device.linear_path), run on the CPU: float32 activations
    meet 16-bit weights in one 16-bit product whatever the number of rows (never widened,
    never oneDNN): the result equals F.linear on the input rounded to the weight's dtype."""
    monkeypatch.setattr(cpu_kernels, "widened", lambda *a: pytest.fail("the accelerator path widened a weight"))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, rows, 64, generator=g)
    w = (torch.randn(32, 64, generator=g) / 8).to(wdtype)
    b = torch.randn(32, generator=g)
    with torch.inference_mode():
        out = linear(x, w, b, path="accelerator")
    assert out.dtype == torch.float32 and out.shape == (1, rows, 32)
    torch.testing.assert_close(out, F.linear(x.to(wdtype), w).float() + b, rtol=0, atol=0)
    # and that is not what the CPU path does for several rows (it widens the weight)
    if rows > 1:
        monkeypatch.undo()
        with torch.inference_mode():
            cpu = linear(x, w, b, path="cpu")
        torch.testing.assert_close(cpu, F.linear(x, w.float(), b), rtol=1e-5, atol=1e-5)


def test_float32_on_the_accelerator_path_is_f_linear(monkeypatch):
    monkeypatch.setattr(onednn, "_OPS", {torch.float32: lambda *a: pytest.fail("oneDNN on the accelerator path")})
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(3, 16, generator=g), torch.randn(8, 16, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w, path="accelerator"), F.linear(x, w), rtol=0, atol=0)


def test_a_decoder_takes_the_path_its_device_chooses():
    from runtime.config.model import ModelConfig
    from runtime.device import linear_path
    from runtime.model.decoder import Decoder

    assert (linear_path("cpu"), linear_path("cuda"), linear_path(torch.device("mps"))) == ("cpu", "accelerator", "accelerator")
    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=32, hidden_size=16, n_layers=1, n_heads=2,
                      n_kv_heads=1, head_dim=8, intermediate_size=32, max_position_embeddings=64, norm_eps=1e-5)
    dec = Decoder(cfg)
    dec.set_linear_path("accelerator")
    paths = {m.path for m in dec.modules() if isinstance(m, Linear)}
    assert paths == {"accelerator"} and dec.linear_path == "accelerator"
    with pytest.raises(ValueError, match="unknown linear path 'gpu'"):
        dec.set_linear_path("gpu")
