"""Plain PyTorch reference of the expert layer (docs/semantics.md), in fp32 on the bf16 values, with
autograd providing every gradient. Deliberately simple: a Python loop over experts."""
import torch
import torch.nn.functional as F


def rel_err(a, b):
    """Relative L2 error of a against b (in fp32)."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def split_gate_linear(h, ffn, interleave):
    if interleave == 0:
        return h[:, :ffn], h[:, ffn:]
    blocks = h.reshape(h.shape[0], ffn // interleave, 2, interleave)
    return blocks[:, :, 0, :].reshape(h.shape[0], ffn), blocks[:, :, 1, :].reshape(h.shape[0], ffn)


def activation(h, kind, ffn, interleave, alpha=1.702, limit=7.0, offset=1.0):
    if kind == "squared-relu":
        return torch.relu(h) ** 2
    g, l = split_gate_linear(h, ffn, interleave)
    if kind == "swiglu":
        return F.silu(g) * l
    if kind == "geglu":
        return gelu_tanh(g) * l
    a = torch.clamp(g, max=limit)
    return a * torch.sigmoid(alpha * a) * (torch.clamp(l, -limit, limit) + offset)


def moe_reference(x, idx, probs, w1, w2, b1=None, b2=None, kind="swiglu", interleave=0, probs_at_combine=False):
    """x [T, H]; idx [T, k] int (-1 empty); probs [T, k]; w1 [E, fc1_out, H]; w2 [E, H, F]."""
    T, H = x.shape
    E, _, ffn = w2.shape
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    xf, w1f, w2f = x.float(), w1.float(), w2.float()
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        p = probs[tok, slot].float().unsqueeze(1)
        h = xf[tok] @ w1f[e].T
        if b1 is not None:
            h = h + b1[e].float()
        a = activation(h, kind, ffn, interleave)
        if not probs_at_combine:
            a = a * p
        out = a @ w2f[e].T
        if b2 is not None:
            out = out + (b2[e].float() * (1 if probs_at_combine else p))
        if probs_at_combine:
            out = out * p
        y = y.index_add(0, tok, out)
    return y
