"""Shared pieces of the plain-PyTorch emulations of the quantized expert layers (test_fp8.py,
test_emulated_formats.py): the layer's data flow with the bf16 roundings it stores, around a
quantized linear that each recipe supplies, and the comparison of a module with its emulation."""
import pytest
import torch

from moe_engine import GroupedMLP
from reference import activation

DEV = "cuda"


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bf16(v):
    return v.bfloat16().float()


class RoundBf16(torch.autograd.Function):
    """Rounds to bf16 in forward (a value the layer stores), passes the gradient as it is."""

    @staticmethod
    def forward(ctx, v):
        return bf16(v)

    @staticmethod
    def backward(ctx, g):
        return g


def layer_emulation(linear, x, idx, probs, w1, w2, b1, b2, kind):
    """The expert layer with probs in the activation, each expert's products through linear(x, w)
    (y = x w^T on the recipe's quantized operands; its backward gives the recipe's dx and dw), and
    the layer's bf16 roundings of h (after fc1 and after its bias), act and Y (after fc2 and after
    its bias). x fp32 [T, H]; idx [T, k] int64; probs [T, k]; w1 [E, fc1_out, H]; w2 [E, H, F]."""
    T, H = x.shape
    E, _, ffn = w2.shape
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)  # token order: the dispatcher's row order
        if tok.numel() == 0:
            continue
        p = probs[tok, slot].unsqueeze(1)
        h = RoundBf16.apply(linear(x[tok], w1[e]))
        h = RoundBf16.apply(h + b1[e])
        a = RoundBf16.apply(activation(h, kind, ffn, 0) * p)
        out = RoundBf16.apply(linear(a, w2[e]))
        out = RoundBf16.apply(out + b2[e] * p)
        y = y.index_add(0, tok, out)
    return y


def compare(mod, linear, x, idx, probs, dy, params=None):
    """mod (a GroupedMLP with bias, swiglu) vs layer_emulation(linear) on the same inputs: relative L2
    errors of the output and every gradient. params: values for the module's parameters first."""
    if params is not None:
        with torch.no_grad():
            for n, p in mod.named_parameters():
                p.copy_(params[n])
    xr = x.detach().clone().requires_grad_()
    pr = probs.detach().clone().requires_grad_()
    y = mod(xr, idx, pr)
    y.backward(dy)
    mod.check_errors()
    ours = {"y": y, "dx": xr.grad, "dprobs": pr.grad, **{n: p.grad for n, p in mod.named_parameters()}}

    w = {n: p.detach().float().clone().requires_grad_() for n, p in mod.named_parameters()}
    xe = x.float().requires_grad_()
    pe = probs.clone().requires_grad_()
    ye = layer_emulation(linear, xe, idx.long(), pe, w["fc1.weight"], w["fc2.weight"], w["fc1.bias"],
                         w["fc2.bias"], "swiglu")
    ye.backward(dy.float())
    emu = {"y": ye, "dx": xe.grad, "dprobs": pe.grad, **{n: t.grad for n, t in w.items()}}
    return {key: rel_err(ours[key], want) for key, want in emu.items()}


def grid(shape, unit, gen):
    """Multiples of unit / 2 in [-3.5, 3.5] * unit, uniformly: products of two such values and their
    sums over a few hundred terms are exact in fp32 (integers below 2^14 times a power of two)."""
    return torch.randint(-7, 8, shape, device=DEV, generator=gen).float() * (unit / 2)


def routing(T, E, k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    probs, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV, generator=g), -1), k, dim=-1)
    return idx.to(torch.int32), probs.float()


def grid_problem(seed=7, T=384, H=256, E=4):
    """The exact-grid comparison's data for a GroupedMLP(H, 384, E, bias=True): parameters (weights on
    a grid of 2^-7, small random biases), x on a grid of 0.5 and dy on a grid of 2^-4 (bf16)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    params = {"fc1.weight": grid((E, 768, H), 2.0 ** -6, gen), "fc2.weight": grid((E, H, 384), 2.0 ** -6, gen),
              "fc1.bias": (torch.randn(E, 768, device=DEV, generator=gen) * 0.1),
              "fc2.bias": (torch.randn(E, H, device=DEV, generator=gen) * 0.1)}
    x = grid((T, H), 1.0, gen).bfloat16()
    dy = grid((T, H), 2.0 ** -3, gen).bfloat16()
    return params, x, dy


def check_primary_weights_from_master(fp8):
    """fp8_weight_refresh="from_master" (fp32 weight parameters, quantized straight from fp32 by
    refresh_fp8_weights()) against bf16 weights refreshed on request: with master values bf16 holds
    exactly, bitwise the same results; a forward before the first refresh is refused; master values
    bf16 cannot hold are quantized from fp32, not from their bf16 rounding (a bf16 round trip in
    the binding would not change the output)."""
    T, H, F_, E, k = 256, 256, 384, 4, 2
    idx, probs = routing(T, E, k, 9)
    x = (torch.randn(T, H, device=DEV, generator=torch.Generator(device=DEV).manual_seed(10)) * 0.5).bfloat16()
    dy = torch.randn(T, H, device=DEV, generator=torch.Generator(device=DEV).manual_seed(11)).bfloat16()
    torch.manual_seed(12)
    runs = {}
    for mode in ("on_request", "from_master"):
        mod = GroupedMLP(H, F_, E, k, max_tokens=T, bias=True, fp8=fp8, fp8_weight_refresh=mode,
                         accumulate_into_main_grad=True)
        if mode == "from_master":
            assert mod.fc1.weight.dtype == torch.float32 and mod.fc1.bias.dtype == torch.bfloat16
            with torch.no_grad():
                for (_, q), (_, src) in zip(mod.named_parameters(), runs["on_request"]["mod"].named_parameters()):
                    q.copy_(src)
            with pytest.raises(ValueError, match="refresh_fp8_weights"):
                mod(x, idx, probs)
        for q in mod.parameters():
            q.main_grad = torch.zeros(q.shape, device=DEV, dtype=torch.float32)
        mod.refresh_fp8_weights()
        xr = x.detach().clone().requires_grad_()
        pr = probs.detach().clone().requires_grad_()
        y = mod(xr, idx, pr)
        y.backward(dy)
        mod.check_errors()
        runs[mode] = {"mod": mod, "y": y, "dx": xr.grad, "dprobs": pr.grad,
                      **{n: q.main_grad for n, q in mod.named_parameters()}}
    for key, want in runs["on_request"].items():
        if key != "mod":
            assert torch.equal(runs["from_master"][key], want), key
    mod = runs["from_master"]["mod"]
    outs = []
    with torch.no_grad():
        master = {n: (q.float() * (1 + 2.0 ** -12 * torch.randn_like(q.float()))) for n, q in mod.named_parameters()
                  if q.dtype == torch.float32}
    for rounded in (False, True):
        with torch.no_grad():
            for n, q in mod.named_parameters():
                if n in master:
                    q.copy_(master[n].bfloat16().float() if rounded else master[n])
        mod.refresh_fp8_weights()
        outs.append(mod(x, idx, probs))
    assert not torch.equal(outs[0], outs[1])
