"""Several micro-batches in flight (pipeline schedules, activation checkpointing): four forwards of
GroupedMLP (and of Dispatcher + GroupedExperts composed by hand), then their backwards in reverse
and in shuffled order -- every output and gradient bitwise equal to running each micro-batch alone
in the order in which the weight gradients accumulate; the same inside one captured CUDA graph;
recompute mode and torch.utils.checkpoint bitwise equal to the default."""
import pytest
import torch
import torch.utils.checkpoint

from moe_engine import Dispatcher, GroupedExperts, GroupedMLP

DEV = "cuda"
T, H, F, E, K = 40, 128, 64, 6, 2


def batch(seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(T, H, device=DEV, generator=g) * 0.5).bfloat16()
    logits = torch.randn(T, E, device=DEV, generator=g) - (seed % 2) * torch.log1p(torch.arange(E, device=DEV))
    probs, idx = torch.topk(torch.softmax(logits, -1), K)
    dy = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    return x, idx.to(torch.int32), probs.float(), dy


def params_of(mod):
    return [q for q in mod.parameters()]


class Composed(torch.nn.Module):
    """Dispatcher + GroupedExperts + unpermute: the layer built from the public pieces."""

    def __init__(self, layer_kwargs, fuse_fc2_dgrad):
        super().__init__()
        at_combine = layer_kwargs.get("probs_at_combine", False)
        align = layer_kwargs.get("align", 0)
        self.d = Dispatcher(T, E, H, topk=K, align=align)
        kw = {k: v for k, v in layer_kwargs.items() if k not in ("align", "recompute")}
        if kw.get("fp8"):
            # The FP8 experts need rows in multiples of 16: the row bound rounded up, as the layer does.
            self.d = Dispatcher(T, E, H, topk=K, align=align, row_bound=(self.d.rows + 15) // 16 * 16)
        # The layer's choice of the fused fc2 dgrad (its dprobs sums in another order than the
        # unfused activation backward's, so both sides must take the same kernels to agree bitwise).
        self.experts = GroupedExperts(H, F, E, self.d.rows, fuse_fc2_dgrad=fuse_fc2_dgrad, **kw)
        self.at_combine = at_combine

    def forward(self, x, idx, probs):
        x_perm, probs_perm, groups, _, plan = self.d.permute(x, idx, probs)
        Y = self.experts(x_perm, groups, None if self.at_combine else probs_perm)
        return self.d.unpermute(Y, plan, probs if self.at_combine else None)


def make(kind, kwargs):
    torch.manual_seed(0)
    if kind == "layer":
        return GroupedMLP(H, F, E, K, max_tokens=T, **kwargs)
    # The layer's initial weights (made first after the seed, as make("layer") does), copied in.
    ref = GroupedMLP(H, F, E, K, max_tokens=T, **kwargs)
    mod = Composed(kwargs, ref.fuse_fc2_dgrad)
    with torch.no_grad():
        for (_, a), (_, b) in zip(mod.experts.named_parameters(), ref.named_parameters()):
            a.copy_(b)
    return mod


def set_main_grads(mod):
    for q in mod.parameters():
        q.main_grad = torch.full(q.shape, 0.25, device=DEV, dtype=torch.float32)


def grads(mod, main_grad):
    return [(q.main_grad if main_grad else q.grad).clone() for q in mod.parameters()]


def run(mod, batches, order, main_grad, delayed, dw_order=None, together=True):
    """Forwards of all batches then backwards in `order` (together), or one at a time in the order
    the weight gradients accumulate. Returns per-batch (y, dx, dprobs) and the final weight grads."""
    mod.zero_grad(set_to_none=True)
    if main_grad:
        set_main_grads(mod)
    experts = mod if isinstance(mod, GroupedMLP) else mod.experts
    leaves = [(x.clone().requires_grad_(), idx, p.clone().requires_grad_(), dy) for x, idx, p, dy in batches]
    outs = [None] * len(batches)
    seq = (dw_order if delayed else order)
    if together:
        for i, (x, idx, p, _) in enumerate(leaves):
            outs[i] = mod(x, idx, p)
        for i in order:
            outs[i].backward(leaves[i][3])
        if delayed:
            # backward_dw serves the oldest pending backward: run them in backward order.
            for _ in order:
                experts.backward_dw()
    else:
        for i in seq:
            x, idx, p, dy = leaves[i]
            outs[i] = mod(x, idx, p)
            outs[i].backward(dy)
            if delayed:
                experts.backward_dw()
    res = [(outs[i].detach().clone(), leaves[i][0].grad.clone(), leaves[i][2].grad.clone()) for i in range(len(batches))]
    return res, grads(mod, main_grad)


VARIANTS = [
    dict(),
    dict(bias=True, probs_at_combine=True, align=16),
    dict(bias=True, accumulate_into_main_grad=True, wgrad_dtype=torch.float32, delay_wgrad=True),
    dict(recompute=True, bias=True),
    dict(fp8="block", align=128, bias=True),
    # FP8 with delayed weight gradients: each state keeps the FP8 copies of dY and dh for backward_dw.
    dict(fp8="block", align=128, accumulate_into_main_grad=True, wgrad_dtype=torch.float32, delay_wgrad=True),
]


@pytest.mark.parametrize("kind", ["layer", "composed"])
@pytest.mark.parametrize("kwargs", VARIANTS, ids=["default", "bias_at_combine", "delayed_main_grad", "recompute",
                                                  "fp8", "fp8_delayed_main_grad"])
def test_in_flight_micro_batches_any_backward_order(kind, kwargs):
    if kind == "composed" and kwargs.get("recompute"):
        pytest.skip("recompute is a layer option")
    mod = make(kind, kwargs)
    batches = [batch(s) for s in range(4)]
    main_grad = kwargs.get("accumulate_into_main_grad", False)
    delayed = kwargs.get("delay_wgrad", False)
    for order in ([3, 2, 1, 0], [2, 0, 3, 1]):
        together, g1 = run(mod, batches, order, main_grad, delayed, dw_order=order)
        alone, g2 = run(mod, batches, order, main_grad, delayed, dw_order=order, together=False)
        for a, b in zip(together, alone):
            for u, v in zip(a, b):
                assert torch.equal(u, v)
        for u, v in zip(g1, g2):
            assert torch.equal(u, v)


def test_in_flight_layer_and_composition_agree_bitwise():
    batches = [batch(s) for s in range(4)]
    for kwargs in VARIANTS[:3] + VARIANTS[4:]:
        a, ga = run(make("layer", kwargs), batches, [0, 1, 2, 3], kwargs.get("accumulate_into_main_grad", False),
                    kwargs.get("delay_wgrad", False), dw_order=[0, 1, 2, 3])
        b, gb = run(make("composed", kwargs), batches, [0, 1, 2, 3], kwargs.get("accumulate_into_main_grad", False),
                    kwargs.get("delay_wgrad", False), dw_order=[0, 1, 2, 3])
        for u, v in zip(a, b):
            assert all(torch.equal(p, q) for p, q in zip(u, v))
        assert all(torch.equal(p, q) for p, q in zip(ga, gb))


@pytest.mark.parametrize("kind", ["layer", "composed"])
def test_in_flight_inside_one_captured_graph(kind):
    mod = make(kind, dict(bias=True))
    batches = [batch(s) for s in range(4)]
    static = [(x.clone().requires_grad_(), idx.clone(), p.clone().requires_grad_(), dy.clone())
              for x, idx, p, dy in batches]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up binds parameters outside the capture
            for x, idx, p, dy in static:
                mod(x, idx, p).backward(dy)
            for x, _, p, _ in static:
                x.grad = p.grad = None
            mod.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [mod(x, idx, p) for x, idx, p, _ in static]
        for i in (2, 0, 3, 1):
            ys[i].backward(static[i][3])
    wgrads = [q.grad for q in mod.parameters()]  # graph-owned: replays rewrite them
    for seed in (10, 20):
        new = [batch(seed + i) for i in range(4)]
        with torch.no_grad():
            for (sx, sidx, sp, sdy), (x, idx, p, dy) in zip(static, new):
                sx.copy_(x), sidx.copy_(idx), sp.copy_(p), sdy.copy_(dy)
        graph.replay()
        got = [(ys[i].clone(), static[i][0].grad.clone(), static[i][2].grad.clone()) for i in range(4)]
        got_w = [g.clone() for g in wgrads]
        alone, alone_w = run(mod, new, [2, 0, 3, 1], False, False, together=False)
        for a, b in zip(got, alone):
            assert all(torch.equal(u, v) for u, v in zip(a, b))
        assert all(torch.equal(u, v) for u, v in zip(got_w, alone_w))


def test_recompute_and_torch_checkpoint_equal_saved_activations():
    batches = [batch(s) for s in range(2)]
    base, gb = run(make("layer", dict(bias=True)), batches, [1, 0], False, False, together=False)
    rec, gr = run(make("layer", dict(bias=True, recompute=True)), batches, [1, 0], False, False, together=False)
    for u, v in zip(base, rec):
        assert all(torch.equal(p, q) for p, q in zip(u, v))
    assert all(torch.equal(p, q) for p, q in zip(gb, gr))
    mod = make("layer", dict(bias=True))
    saved_state = mod.state_bytes()
    assert make("layer", dict(bias=True, recompute=True)).state_bytes() < saved_state / 4
    for i in (1, 0):
        x, idx, p, dy = batches[i]
        xr, pr = x.clone().requires_grad_(), p.clone().requires_grad_()
        y = torch.utils.checkpoint.checkpoint(mod, xr, idx, pr, use_reentrant=False)
        y.backward(dy)
        assert torch.equal(y, base[i][0]) and torch.equal(xr.grad, base[i][1]) and torch.equal(pr.grad, base[i][2])
    assert all(torch.equal(q.grad, g) for q, g in zip(mod.parameters(), gb))
