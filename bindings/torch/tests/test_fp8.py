"""GroupedMLP(fp8="block") against a plain-PyTorch emulation of the same recipe (docs/layer.md, FP8
experts): every GEMM operand quantized to FP8 E4M3 with fp32 block scales -- tokens and gradients
in 1x128 blocks along the reduction (rowwise for fprop / dgrad, columnwise along each expert's
tokens for the weight gradients), weights in 128x128 blocks -- the products taken in fp64 on the
dequantized values, and the bf16 roundings of the layer (h after fc1 and after its bias, act, Y
after fc2 and after its bias, dact, dh) applied where the layer stores bf16.

Tolerance: relative L2 error <= 1e-2 for the output and every gradient. What remains between the
two is fp32 accumulation order in the FP8 GEMMs (at most 2^-9 of sum|ab|, tests/gpu/
test_fp8_grouped_gemm.cu) and the rare E4M3 or bf16 rounding that such a difference flips; the
recipe's own error against the bf16 layer is ~6% (test_grouped_mlp.py), a wrong block, scale or
copy O(1)."""
import torch
import torch.nn.functional as F

from moe_engine import GroupedMLP
from reference import activation

DEV = "cuda"
BLOCK = 128


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _scales(amax):
    # scale = 448 / amax in fp32, 1 where amax is 0, inf or NaN; scale_inv = fp32(1 / scale).
    ok = (amax > 0) & torch.isfinite(amax)
    scale = torch.where(ok, 448.0 / torch.where(ok, amax, torch.ones_like(amax)), torch.ones_like(amax))
    return scale, 1.0 / scale


def _e4m3(v):
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def q_rows(x):
    """FP8 block quantize-dequantize of fp32 x [M, K] in 1 x 128 blocks along K."""
    M, K = x.shape
    pad = (-K) % BLOCK
    b = F.pad(x, (0, pad)).view(M, -1, BLOCK)
    scale, inv = _scales(b.abs().amax(-1, keepdim=True))
    return (_e4m3(b * scale) * inv).view(M, -1)[:, :K]


def q_cols(x):
    """The same in 128 x 1 blocks along M (the columnwise copy), blocks starting at row 0."""
    return q_rows(x.t().contiguous()).t()


def q_tiles(w):
    """128 x 128 blocks of fp32 w [N, K]."""
    N, K = w.shape
    pn, pk = (-N) % BLOCK, (-K) % BLOCK
    t = F.pad(w, (0, pk, 0, pn)).view((N + pn) // BLOCK, BLOCK, (K + pk) // BLOCK, BLOCK)
    scale, inv = _scales(t.abs().amax(dim=(1, 3), keepdim=True))
    return (_e4m3(t * scale) * inv).view(N + pn, K + pk)[:N, :K]


def bf16(v):
    return v.bfloat16().float()


class _RoundBf16(torch.autograd.Function):
    """Rounds to bf16 in forward (a value the layer stores), passes the gradient as it is."""

    @staticmethod
    def forward(ctx, v):
        return bf16(v)

    @staticmethod
    def backward(ctx, g):
        return g


class _Fp8Linear(torch.autograd.Function):
    """One expert's y = x W^T on FP8 operands: fprop q_rows(x) q_tiles(W)^T; dgrad q_rows(dy) q_tiles(W)
    written in bf16 (the layer stores dact / dx_perm in bf16); wgrad q_cols(dy)^T q_cols(x) over the
    expert's tokens in dispatch order (its rows start on a 128-row boundary with A = 128). dy is the
    bf16 gradient the layer stores (dY, or dh after the activation backward)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (q_rows(x).double() @ q_tiles(w).double().t()).float()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = bf16(dy)
        dx = bf16((q_rows(dy).double() @ q_tiles(w).double()).float())
        dw = (q_cols(dy).double().t() @ q_cols(x).double()).float()
        return dx, dw


def fp8_emulation(x, idx, probs, w1, w2, b1, b2, kind):
    """The FP8 layer in plain PyTorch, probs in the activation; the same signature as moe_reference."""
    T, H = x.shape
    E, _, ffn = w2.shape
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)  # token order: the dispatcher's row order
        if tok.numel() == 0:
            continue
        p = probs[tok, slot].unsqueeze(1)
        h = _RoundBf16.apply(_Fp8Linear.apply(x[tok], w1[e]))
        h = _RoundBf16.apply(h + b1[e])
        a = _RoundBf16.apply(activation(h, kind, ffn, 0) * p)
        out = _RoundBf16.apply(_Fp8Linear.apply(a, w2[e]))
        out = _RoundBf16.apply(out + b2[e] * p)
        y = y.index_add(0, tok, out)
    return y


def test_fp8_layer_matches_the_plain_pytorch_emulation_of_the_recipe():
    T, H, F_, E, k = 384, 256, 384, 4, 2
    torch.manual_seed(5)
    mod = GroupedMLP(H, F_, E, k, max_tokens=T, bias=True, fp8="block")
    x = (torch.randn(T, H, device=DEV) * 0.5).bfloat16()
    g = torch.Generator(device=DEV).manual_seed(6)
    probs, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV, generator=g), -1), k, dim=-1)
    idx, probs = idx.to(torch.int32), probs.float()
    dy = torch.randn(T, H, device=DEV, generator=g).bfloat16()

    xr = x.detach().clone().requires_grad_()
    pr = probs.detach().clone().requires_grad_()
    y = mod(xr, idx, pr)
    y.backward(dy)
    mod.check_errors()
    ours = {"y": y, "dx": xr.grad, "dprobs": pr.grad, **{n: p.grad for n, p in mod.named_parameters()}}

    w = {n: p.detach().float().clone().requires_grad_() for n, p in mod.named_parameters()}
    xe = x.float().requires_grad_()
    pe = probs.clone().requires_grad_()
    ye = fp8_emulation(xe, idx.long(), pe, w["fc1.weight"], w["fc2.weight"], w["fc1.bias"], w["fc2.bias"], "swiglu")
    ye.backward(dy.float())
    emu = {"y": ye, "dx": xe.grad, "dprobs": pe.grad, **{n: t.grad for n, t in w.items()}}

    errs = {key: rel_err(ours[key], want) for key, want in emu.items()}
    print("fp8 layer vs the emulation, relative L2:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert all(err <= 1e-2 for err in errs.values()), errs
