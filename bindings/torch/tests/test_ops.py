"""The functional operators (grouped GEMM, permute + pad, unpermute + unpad) against plain
PyTorch: data movement bitwise, fp32-accumulated results within bf16 rounding."""
import torch

from moe_engine import Dispatcher, grouped_mm

DEV = "cuda"


def test_grouped_mm_and_its_gradients():
    torch.manual_seed(0)
    E, K, N = 5, 128, 96
    sizes = torch.tensor([7, 0, 33, 1, 19])
    offs = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(torch.int32).to(DEV)
    R = int(sizes.sum()) + 3
    x = torch.randn(R, K, device=DEV).bfloat16().requires_grad_()
    w = (torch.randn(E, N, K, device=DEV) * 0.1).bfloat16().requires_grad_()
    y = grouped_mm(x, w, offs)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yr = torch.zeros(R, N, device=DEV)
    bounds = offs.tolist()
    parts = [xr[bounds[e]:bounds[e + 1]] @ wr[e].T for e in range(E)]
    yr = torch.cat(parts + [torch.zeros(R - bounds[-1], N, device=DEV)])
    yr.backward(dy.float())
    assert ((y.float() - yr).norm() / yr.norm()) < 1e-2
    assert torch.count_nonzero(y[bounds[-1]:]) == 0
    assert ((x.grad.float()[:bounds[-1]] - xr.grad[:bounds[-1]]).norm() / xr.grad.norm()) < 1e-2
    assert ((w.grad.float() - wr.grad).norm() / wr.grad.norm()) < 1e-2
    assert torch.count_nonzero(w.grad[1]) == 0  # empty group: zero gradient


def test_permute_unpermute_roundtrip_and_gradients():
    torch.manual_seed(1)
    T, E, k, H, A = 37, 8, 2, 128, 16
    x = torch.randn(T, H, device=DEV).bfloat16().requires_grad_()
    probs, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), k)
    idx = idx.to(torch.int32)
    probs = probs.float().requires_grad_()
    d = Dispatcher(T, E, H, topk=k, align=A)
    x_perm, probs_perm, groups, counts = d.permute(x, idx, probs)
    assert counts.tolist() == torch.bincount(idx.flatten().long(), minlength=E).tolist()
    g = groups.tolist()
    for e in range(E):
        tok = (idx == e).nonzero(as_tuple=True)[0]  # stable token order inside the expert
        assert torch.equal(x_perm[g[e]:g[e] + len(tok)], x[tok])  # bitwise
        assert (g[e + 1] - g[e]) % A == 0
        assert torch.count_nonzero(x_perm[g[e] + len(tok):g[e + 1]]) == 0  # pad rows zero
    y = d.unpermute(x_perm, probs, merge_probs=True)
    want = (x.float().unsqueeze(1) * probs.detach().unsqueeze(2)).sum(1)
    assert ((y.float() - want).norm() / want.norm()) < 1e-2
    dy = torch.randn_like(y)
    (y.float() * dy.float()).sum().backward()
    xr, pr = x.detach().float().requires_grad_(), probs.detach().clone().requires_grad_()
    ((xr.unsqueeze(1) * pr.unsqueeze(2)).sum(1) * dy.float()).sum().backward()
    assert ((x.grad.float() - xr.grad).norm() / xr.grad.norm()) < 1e-2
    assert ((probs.grad - pr.grad).norm() / pr.grad.norm()) < 1e-2
    bad = idx.clone()
    bad[3, 1] = bad[3, 0]  # duplicate expert in a row
    d.permute(x.detach(), bad, probs.detach())
    try:
        d.check_errors()
        raise AssertionError("duplicate expert not reported")
    except ValueError as e:
        assert "twice" in str(e)
