"""MoELayer's gate as one autograd node with the experts' input (moe_layer._GateAndInput), on the CPU:
the logits are F.linear's bit for bit; x's gradient is the experts' part plus the gate's part added
by one GEMM with beta = 1 (torch.addmm, the same call on the GPU); the weight and bias gradients are
nn.Linear's; a backward that reaches only one of the two outputs gives that output's gradient alone."""
import torch
import torch.nn.functional as F

from moe_engine.moe_layer import _GateAndInput

T, H, E = 24, 16, 8


def tensors(dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(E, H, generator=g) * 0.1).to(dtype)
    b = (torch.randn(E, generator=g) * 0.1).to(dtype) if bias else None
    d_logits = torch.randn(T, E, generator=g).to(dtype)
    d_x = torch.randn(T, H, generator=g).to(dtype)
    return x, w, b, d_logits, d_x


def leaves(*ts):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in ts]


def test_forward_and_both_gradients():
    for dtype in (torch.bfloat16, torch.float32):
        for bias in (True, False):
            x, w, b, d_logits, d_x = tensors(dtype, 1, bias)
            xr, wr, br = leaves(x, w, b)
            logits, x_out = _GateAndInput.apply(xr, wr, br)
            assert torch.equal(logits, F.linear(x, w, b))
            assert torch.equal(x_out, x) and x_out.data_ptr() == xr.data_ptr()  # the experts read x itself
            torch.autograd.backward([logits, x_out], [d_logits, d_x])
            assert torch.equal(xr.grad, torch.addmm(d_x, d_logits, w))
            # Against autograd's own sum of nn.Linear's dx and the experts' dx: the same sum, rounded
            # once instead of twice (exact in fp32 up to the order of the GEMM's additions).
            xl, wl, bl = leaves(x, w, b)
            torch.autograd.backward([F.linear(xl, wl, bl), xl.view_as(xl)], [d_logits, d_x])
            assert torch.equal(wr.grad, wl.grad) and (b is None or torch.equal(br.grad, bl.grad))
            tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
            assert ((xr.grad.float() - xl.grad.float()).abs() <= tol * (xl.grad.float().abs() + 1)).all()


def test_one_output_reached():
    x, w, b, d_logits, d_x = tensors(torch.float32, 2)
    # Only the logits: dx is the gate's part alone.
    xr, wr, br = leaves(x, w, b)
    logits, _ = _GateAndInput.apply(xr, wr, br)
    logits.backward(d_logits)
    assert torch.equal(xr.grad, d_logits.mm(w)) and torch.equal(wr.grad, d_logits.t().mm(x))
    # Only x: its gradient passes through, no weight gradient.
    xr, wr, br = leaves(x, w, b)
    _, x_out = _GateAndInput.apply(xr, wr, br)
    x_out.backward(d_x)
    assert torch.equal(xr.grad, d_x) and wr.grad is None and br.grad is None


def test_frozen_gate_and_input_without_gradient():
    x, w, b, d_logits, d_x = tensors(torch.float32, 3)
    # A frozen gate: dx still gets both parts, no weight gradient is computed.
    xr = x.clone().requires_grad_()
    logits, x_out = _GateAndInput.apply(xr, w, b)
    torch.autograd.backward([logits, x_out], [d_logits, d_x])
    assert torch.equal(xr.grad, torch.addmm(d_x, d_logits, w))
    # x without a gradient (e.g. the first layer's input): the gate's weight gradient alone.
    wr, br = leaves(w, b)
    logits, x_out = _GateAndInput.apply(x, wr, br)
    logits.backward(d_logits)
    assert torch.equal(wr.grad, d_logits.t().mm(x)) and torch.equal(br.grad, d_logits.sum(0))


def test_owned_dx_gets_the_gate_part_in_place():
    # dx_owned (MoELayer: the experts' op allocated dx and no hook sees it): the sum lands in the
    # experts' dx itself, no copy of it first; the same values as the out-of-place addmm. (x.grad is
    # a copy here only because this test still holds the experts' dx: autograd takes a gradient
    # nothing else holds as it is.)
    for dtype in (torch.bfloat16, torch.float32):
        x, w, b, d_logits, d_x = tensors(dtype, 4)
        xr, wr, br = leaves(x, w, b)
        experts_dx = d_x.clone()
        logits, x_out = _GateAndInput.apply(xr, wr, br, True)
        torch.autograd.backward([logits, x_out], [d_logits, experts_dx])
        assert torch.equal(xr.grad, torch.addmm(d_x, d_logits, w))
        assert torch.equal(experts_dx, xr.grad)
        # Not owned (the default): the experts' dx is left as it was.
        xr, wr, br = leaves(x, w, b)
        experts_dx = d_x.clone()
        logits, x_out = _GateAndInput.apply(xr, wr, br)
        torch.autograd.backward([logits, x_out], [d_logits, experts_dx])
        assert torch.equal(experts_dx, d_x) and torch.equal(xr.grad, torch.addmm(d_x, d_logits, w))
