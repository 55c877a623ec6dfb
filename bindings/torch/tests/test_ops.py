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
    x_perm, probs_perm, groups, counts, plan = d.permute(x, idx, probs)
    assert counts.tolist() == torch.bincount(idx.flatten().long(), minlength=E).tolist()
    g = groups.tolist()
    for e in range(E):
        tok = (idx == e).nonzero(as_tuple=True)[0]  # stable token order inside the expert
        assert torch.equal(x_perm[g[e]:g[e] + len(tok)], x[tok])  # bitwise
        assert (g[e + 1] - g[e]) % A == 0
        assert torch.count_nonzero(x_perm[g[e] + len(tok):g[e + 1]]) == 0  # pad rows zero
    y = d.unpermute(x_perm, plan, probs)
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


def test_unpermute_merges_with_the_probs_it_is_given():
    """Not with those of the permute: a second set of probs gives the merge of those."""
    torch.manual_seed(2)
    T, E, k, H = 16, 4, 2, 128
    x = torch.randn(T, H, device=DEV).bfloat16()
    probs, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), k)
    idx, probs = idx.to(torch.int32), probs.float()
    d = Dispatcher(T, E, H, topk=k)
    x_perm, _, _, _, plan = d.permute(x, idx, probs)
    other = torch.rand_like(probs)
    y = d.unpermute(x_perm, plan, other)
    want = (x.float().unsqueeze(1) * other.unsqueeze(2)).sum(1)
    assert ((y.float() - want).norm() / want.norm()) < 1e-2
    unweighted = d.unpermute(x_perm, plan)
    assert ((unweighted.float() - 2 * x.float()).norm() / x.float().norm()) < 1e-2


def test_in_flight_dispatch_plans_backward_in_any_order():
    """Four permutes of the same T alive at once; backwards in reverse order equal each alone."""
    T, E, k, H = 24, 6, 2, 128
    d = Dispatcher(T, E, H, topk=k, align=16)

    def batch(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x = torch.randn(T, H, device=DEV, generator=g).bfloat16().requires_grad_()
        probs, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV, generator=g), -1), k)
        dy = torch.randn(T, H, device=DEV, generator=g).bfloat16()
        return x, idx.to(torch.int32), probs.float().requires_grad_(), dy

    def run(b, keep=False):
        x, idx, probs, dy = b
        x_perm, probs_perm, _, _, plan = d.permute(x, idx, probs)
        y = d.unpermute(x_perm * 2, plan, probs)
        return y, dy

    batches = [batch(s) for s in range(4)]
    outs = [run(b) for b in batches]
    for i in (3, 1, 0, 2):
        outs[i][0].backward(outs[i][1])
    together = [(o[0].detach().clone(), b[0].grad.clone(), b[2].grad.clone()) for o, b in zip(outs, batches)]
    for i, b in enumerate(batches):
        b[0].grad = b[2].grad = None
        y, dy = run(b)
        y.backward(dy)
        assert torch.equal(y, together[i][0]) and torch.equal(b[0].grad, together[i][1])
        assert torch.equal(b[2].grad, together[i][2])


def test_grouped_mm_reports_bad_offsets_and_names_arguments():
    import pytest
    from moe_engine import grouped_mm_check_errors
    x = torch.randn(32, 64, device=DEV).bfloat16()
    w = torch.randn(3, 16, 64, device=DEV).bfloat16()
    grouped_mm_check_errors()
    grouped_mm(x, w, torch.tensor([0, 20, 10, 32], dtype=torch.int32, device=DEV))  # decreasing
    with pytest.raises(ValueError, match="group offsets"):
        grouped_mm_check_errors()
    grouped_mm(x, w, torch.tensor([0, 10, 20, 32], dtype=torch.int32, device=DEV))
    grouped_mm_check_errors()  # valid offsets raise nothing
    with pytest.raises(ValueError, match="'x'"):
        grouped_mm(x[0], w, torch.tensor([0, 10, 20, 32], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="'w'"):
        grouped_mm(x, w[0, 0], torch.tensor([0, 10, 20, 32], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="'group_offsets'"):
        grouped_mm(x, w, torch.tensor([0, 10, 32], dtype=torch.int32, device=DEV))
    d = Dispatcher(8, 4, 64, topk=1)
    with pytest.raises(ValueError, match="'x'"):
        d.permute(x[0], torch.zeros(8, 1, dtype=torch.int32, device=DEV), torch.ones(8, 1, device=DEV))
