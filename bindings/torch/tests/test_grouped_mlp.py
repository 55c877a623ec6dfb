"""GroupedMLP against the plain PyTorch reference: outputs and every gradient (x, probs, weights,
biases), both weight layouts (bitwise equal), main_grad accumulation, delayed wgrad with hooks,
state_dict across layouts, CUDA graph capture + replay, torch.compile, empty experts, bad input.

Tolerance: the layer keeps bf16 intermediates (h, act, Y) where the reference keeps fp32, so
results differ by a few bf16 roundings: relative L2 error <= 2e-2 (a wrong index, prob or bias
gives O(1))."""
import pytest
import torch

from moe_engine import Dispatcher, GroupedExperts, GroupedMLP, Router
from reference import moe_reference, rel_err

DEV = "cuda"


def routing(T, E, k, seed, skew=0.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(T, E, device=DEV, generator=g) - skew * torch.log1p(torch.arange(E, device=DEV))
    probs, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return idx.to(torch.int32), probs.float()


def make(T=48, H=128, F=64, E=6, k=2, seed=0, **kw):
    torch.manual_seed(seed)
    mod = GroupedMLP(H, F, E, k, max_tokens=max(T, 1), **kw)
    x = (torch.randn(T, H, device=DEV) * 0.5).bfloat16()
    idx, probs = routing(T, E, k, seed)
    return mod, x, idx, probs


def grouped_params(mod):
    """The module's parameters stacked as [E, ...] tensors (either layout)."""
    out = {}
    for p in ("fc1", "fc2"):
        for s in ("weight", "bias"):
            ps = mod.expert_params(p, s)
            if ps:
                out[f"{p}.{s}"] = torch.stack(ps) if mod.per_expert_weights else ps[0]
    return out


def output_grad(x, seed=1234):
    """The same dy for every run of a test (layouts and modes are compared bitwise)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(x.shape, device=DEV, generator=g).to(x.dtype)


def run_both(mod, x, idx, probs, kind="swiglu", interleave=0, probs_at_combine=False):
    dy = output_grad(x)
    xr = x.detach().clone().requires_grad_()
    pr = probs.detach().clone().requires_grad_()
    y = mod(xr, idx, pr)
    y.backward(dy)
    ours = {"y": y, "dx": xr.grad, "dprobs": pr.grad}
    for p in ("fc1", "fc2"):
        for s in ("weight", "bias"):
            ps = mod.expert_params(p, s)
            if ps:
                ours[f"{p}.{s}"] = torch.stack([q.grad for q in ps]) if mod.per_expert_weights else ps[0].grad
    params = {k: v.detach().clone().requires_grad_() for k, v in grouped_params(mod).items()}
    xr2 = x.detach().clone().float().requires_grad_()
    pr2 = probs.detach().clone().requires_grad_()
    yr = moe_reference(xr2, idx, pr2, params["fc1.weight"], params["fc2.weight"], params.get("fc1.bias"),
                       params.get("fc2.bias"), kind, interleave, probs_at_combine)
    yr.backward(dy.float())
    ref = {"y": yr, "dx": xr2.grad, "dprobs": pr2.grad}
    ref.update({k: v.grad for k, v in params.items()})
    return ours, ref


@pytest.mark.parametrize("fuse_fc2_dgrad", [False, True])
@pytest.mark.parametrize("fuse_fc1,save_x_perm", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("kind,bias,interleave,at_combine,per_expert", [
    ("swiglu", False, 0, False, False),
    ("swiglu", True, 32, False, True),
    ("swiglu", True, 0, True, False),
    ("geglu", True, 16, False, False),
    ("clamped-swiglu", True, 32, False, True),
    ("squared-relu", True, 0, True, False),
])
def test_matches_reference(kind, bias, interleave, at_combine, per_expert, fuse_fc1, save_x_perm, fuse_fc2_dgrad):
    mod, x, idx, probs = make(activation=kind, bias=bias, glu_interleave=interleave, probs_at_combine=at_combine,
                              per_expert_weights=per_expert, fuse_fc1=fuse_fc1, save_x_perm=save_x_perm,
                              fuse_fc2_dgrad=fuse_fc2_dgrad)
    with torch.no_grad():  # non-zero biases, so that adding them is tested too
        for name, q in mod.named_parameters():
            if ".bias" in name:
                q.normal_(0, 0.5)
    ours, ref = run_both(mod, x, idx, probs, kind, interleave, at_combine)
    for name in ref:
        assert ours[name] is not None, name
        assert rel_err(ours[name], ref[name]) < 2e-2, (name, rel_err(ours[name], ref[name]))


def test_fused_dgrad_state_keeps_no_activation():
    # The fused fc2 dgrad recomputes the activation from the saved pre-activation: a forward in
    # flight keeps rows x F x 2 bytes less (rows = T * k here).
    unfused, *_ = make(fuse_fc2_dgrad=False)
    fused, *_ = make(fuse_fc2_dgrad=True)
    assert fused.fuse_fc2_dgrad and not unfused.fuse_fc2_dgrad
    assert unfused.state_bytes() - fused.state_bytes() == 48 * 2 * 64 * 2
    # The default fuses only where it costs no time: F <= 256, or without x_perm (the fused fc1's
    # default up to F = 2048), where the fc2 weight gradient gathers dy too.
    assert make(F=512, save_x_perm=True)[0].fuse_fc2_dgrad is False
    wide = make(F=512)[0]
    assert not wide.save_x_perm and wide.fuse_fc2_dgrad
    large = make(F=4096)[0]  # above the fused fc1's default: x_perm kept, dgrad unfused
    assert not large.fuse_fc1 and large.save_x_perm and not large.fuse_fc2_dgrad
    forced = make(F=4096, fuse_fc1=True)[0]  # a forced fused fc1 above 2048 keeps x_perm
    assert forced.save_x_perm and not forced.fuse_fc2_dgrad
    # Recompute mode rebuilds x_perm; a bias keeps dY_perm: neither takes the fused dgrad above 256.
    for kwargs in (dict(recompute=True), dict(bias=True)):
        assert not make(F=512, **kwargs)[0].fuse_fc2_dgrad, kwargs


def test_token_chunks_are_bitwise_the_whole_batch():
    # fc2 + combine and the fc1 dgrad + dx sum in pieces of consecutive tokens: the same bits, in a
    # smaller workspace (the default here: fused fc1 without x_perm and the fused fc2 dgrad).
    whole, x, idx, probs = make(T=47, seed=5)
    a, ref = run_both(whole, x, idx, probs)
    for name in ref:
        assert rel_err(a[name], ref[name]) < 2e-2, name
    for n in (2, 3, 7):
        chunked, *_ = make(T=47, seed=5, token_chunks=n)
        b, _ = run_both(chunked, x, idx, probs)
        for name in a:
            assert torch.equal(a[name], b[name]), (n, name)
        assert chunked.workspace_bytes() < whole.workspace_bytes()
    with pytest.raises(ValueError, match="token_chunks"):
        GroupedMLP(128, 64, 6, 2, max_tokens=48, bias=True, token_chunks=2)


def test_layouts_bitwise_equal_and_state_dict_converts():
    grouped, x, idx, probs = make(bias=True, seed=3)
    with torch.no_grad():
        grouped.fc1.bias.normal_(0, 0.5)
        grouped.fc2.bias.normal_(0, 0.5)
    per = GroupedMLP(128, 64, 6, 2, max_tokens=48, bias=True, per_expert_weights=True)
    sd = grouped.state_dict()
    assert "fc1.weight" in sd and "fc1.weight0" not in sd
    per.load_state_dict(sd)  # split grouped -> per expert
    assert torch.equal(per.fc1.weight3, grouped.fc1.weight[3])
    a, _ = run_both(grouped, x, idx, probs)
    b, _ = run_both(per, x, idx, probs)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    back = GroupedMLP(128, 64, 6, 2, max_tokens=48, bias=True)
    back.load_state_dict(per.state_dict())  # fold per expert -> grouped
    assert torch.equal(back.fc2.weight, grouped.fc2.weight)
    incomplete = per.state_dict()
    del incomplete["fc2.weight4"]
    with pytest.raises(KeyError, match="fc2.weight4"):
        back.load_state_dict(incomplete)


def test_main_grad_accumulation_and_delayed_wgrad_with_hooks():
    base, x, idx, probs = make(bias=True, seed=5)
    want, _ = run_both(base, x, idx, probs)
    for delay, save_x_perm in ((False, True), (True, True), (False, False), (True, False)):
        mod = GroupedMLP(128, 64, 6, 2, max_tokens=48, bias=True, accumulate_into_main_grad=True,
                         delay_wgrad=delay, save_x_perm=save_x_perm)
        mod.load_state_dict(base.state_dict())
        start = {}
        for name, q in mod.named_parameters():
            q.main_grad = torch.randn(q.shape, device=DEV, dtype=torch.float32)
            start[name] = q.main_grad.clone()
        fired = []
        mod.register_wgrad_hook(lambda name, q: fired.append(name))
        xr = x.detach().clone().requires_grad_()
        y = mod(xr, idx, probs)
        y.backward(output_grad(x))
        if delay:
            assert fired == []
            mod.backward_dw()
        assert fired == ["fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias"]
        for name, q in mod.named_parameters():
            assert q.grad is None
            added = q.main_grad - start[name]
            assert rel_err(added, want[name].float()) < 1e-2, name


class _BackwardSpy:
    """Stands in for torch.ops.moe_engine in moe_engine.module: records the gradient lists each
    backward op is given, and forwards every call to the real operators."""

    def __init__(self, ops):
        self._ops, self.grad_lists = ops, []

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if name not in ("mlp_backward", "experts_backward"):
            return fn

        def spy(*args):
            self.grad_lists.append([len(lst) for lst in args[-4:]])
            return fn(*args)
        return spy


@pytest.mark.parametrize("delay", [False, True])
def test_frozen_experts_compute_no_weight_gradients(monkeypatch, delay):
    # Expert parameters that want no gradient (frozen experts, adapters trained around them), for the
    # layer and for the experts behind the library's dispatcher: y, dx and dprobs bitwise those of the
    # same module trainable, and no parameter gets a gradient or fires a hook. Immediate mode: the op
    # is given no gradient buffers (so it runs only the GEMMs of dx). Delayed mode, where the op always
    # gets none in backward: backward_dw() has nothing to do for a frozen backward.
    import moe_engine.module
    base, x, idx, probs = make(bias=True, seed=9)
    with torch.no_grad():
        base.fc2.bias.normal_(0, 0.5)
    dy = output_grad(x)
    disp = Dispatcher(48, 6, 128, topk=2)

    def run(experts_alone, frozen):
        if experts_alone:
            mod = GroupedExperts(128, 64, 6, max_rows=disp.rows, bias=True, delay_wgrad=delay)
        else:
            mod = GroupedMLP(128, 64, 6, 2, max_tokens=48, bias=True, delay_wgrad=delay)
        mod.load_state_dict(base.state_dict())
        mod.requires_grad_(not frozen)
        fired = []
        mod.register_wgrad_hook(lambda name, q: fired.append(name))
        spy = _BackwardSpy(moe_engine.module._ops)
        monkeypatch.setattr(moe_engine.module, "_ops", spy)
        xr = x.detach().clone().requires_grad_()
        pr = probs.detach().clone().requires_grad_()
        if experts_alone:
            x_perm, pp, offsets, _, plan = disp.permute(xr, idx, pr)
            y = disp.unpermute(mod(x_perm, offsets, pp), plan)
        else:
            y = mod(xr, idx, pr)
        y.backward(dy)
        monkeypatch.setattr(moe_engine.module, "_ops", spy._ops)
        if delay:
            mod.backward_dw()
        return {"y": y, "dx": xr.grad, "dprobs": pr.grad}, spy.grad_lists, fired, mod

    for experts_alone in (False, True):
        want, want_lists, want_fired, _ = run(experts_alone, frozen=False)
        got, lists, fired, mod = run(experts_alone, frozen=True)
        for name in want:
            assert torch.equal(got[name], want[name]), (experts_alone, name)
        assert lists == [[0, 0, 0, 0]]
        if not delay:
            assert want_lists == [[1, 1, 1, 1]]  # trainable: the op got the four gradient buffers
        assert want_fired and fired == []
        assert all(q.grad is None for q in mod.parameters())


def test_cuda_graph_capture_and_replay_with_new_data():
    mod, x, idx, probs = make(bias=True, align=16, seed=7)
    sx = x.clone().requires_grad_()
    sidx, sprobs = idx.clone(), probs.clone().requires_grad_()
    sdy = torch.randn_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up binds parameters and gradients outside the capture
            mod(sx, sidx, sprobs).backward(sdy)
            sx.grad = sprobs.grad = None
            mod.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sy = mod(sx, sidx, sprobs)
        sy.backward(sdy)
    for seed in (11, 12):
        new_x = (torch.randn_like(x.float()) * 0.5).bfloat16()
        new_idx, new_probs = routing(x.shape[0], 6, 2, seed, skew=float(seed - 11))
        new_dy = torch.randn_like(x)
        with torch.no_grad():
            sx.copy_(new_x), sidx.copy_(new_idx), sprobs.copy_(new_probs), sdy.copy_(new_dy)
        g.replay()
        got = (sy.clone(), sx.grad.clone(), sprobs.grad.clone())
        ex = new_x.clone().requires_grad_()
        ep = new_probs.clone().requires_grad_()
        ey = mod(ex, new_idx, ep)
        ey.backward(new_dy)
        assert torch.equal(got[0], ey) and torch.equal(got[1], ex.grad) and torch.equal(got[2], ep.grad)


def test_modules_dropped_during_a_capture_leave_it_intact():
    # Destroying an operator's library object frees device memory (cudaFree), which a capture in
    # progress forbids, and the garbage collector may collect a dropped module at any allocation inside
    # torch.cuda.graph: such objects are destroyed at the next release outside the capture.
    import gc
    import weakref
    from moe_engine import _handles
    dropped = [make(seed=1)[0], make(seed=2, per_expert_weights=True)[0], GroupedExperts(128, 64, 6, 96),
               Dispatcher(48, 6, 128, topk=2), Router(6, 2, max_tokens=48)]
    refs = [weakref.ref(m) for m in dropped]
    mod, x, idx, probs = make(seed=3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mod(x, idx, probs)  # warm-up binds the parameters outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mod(x, idx, probs)
        dropped.clear()
        gc.collect()
        y_after = mod(x, idx, probs)
    assert all(r() is None for r in refs)
    assert len(_handles._deferred) == len(refs)
    g.replay()
    want = mod(x, idx, probs)
    assert torch.equal(y, want) and torch.equal(y_after, want)
    make(seed=4)  # dropped at once: a release outside the capture, which destroys the deferred objects too
    assert not _handles._deferred


def test_a_module_dropped_after_its_backward_is_freed_without_the_garbage_collector():
    # The hooks a module registers on itself and its parameters hold it weakly, so the module -- and
    # the device memory of its library object -- goes when its last reference does.
    import gc
    import weakref
    gc.disable()
    try:
        for kw in (dict(), dict(per_expert_weights=True, bias=True)):
            mod, x, idx, probs = make(seed=5, **kw)
            fired = []
            mod.register_wgrad_hook(lambda name, q: fired.append(name))
            x.requires_grad_()
            mod(x, idx, probs).backward(output_grad(x))
            assert fired, "the write-mode hooks still fire"
            ref = weakref.ref(mod)
            del mod
            assert ref() is None, f"{kw}: the module outlived its last reference"
    finally:
        gc.enable()


def test_copies_run_on_library_objects_of_their_own():
    # copy.deepcopy (an EMA or reference model) and torch.save / torch.load of whole modules: a copy
    # sharing the original's library object would lose it with the original and bind its weights to
    # the same op in turn.
    import copy
    import io
    import weakref
    mod, x, idx, probs = make(bias=True, seed=9)
    router, dispatcher = Router(6, 2, max_tokens=48), Dispatcher(48, 6, 128, topk=2)
    saved = io.BytesIO()
    torch.save(mod, saved)
    saved.seek(0)
    twins = [copy.deepcopy(mod), torch.load(saved, weights_only=False)]
    router_twin, dispatcher_twin = copy.deepcopy(router), copy.deepcopy(dispatcher)
    # Each kind of object (layer, router, dispatcher) numbers its handles on its own.
    assert len({mod._handle, *(t._handle for t in twins)}) == 3, "a copy shares its original's library object"
    assert router_twin.handle != router.handle and dispatcher_twin.handle != dispatcher.handle
    dy = output_grad(x)
    want = mod(x, idx, probs).detach()  # no autograd graph keeping mod alive
    logits = torch.randn(48, 6, device=DEV)
    want_routing = router(logits).indices
    want_rows = dispatcher.permute(x, idx, probs)[0]
    originals = [weakref.ref(o) for o in (mod, router, dispatcher)]
    del mod, router, dispatcher
    assert all(r() is None for r in originals), "an original outlived its last reference"
    assert torch.equal(router_twin(logits).indices, want_routing)
    assert torch.equal(dispatcher_twin.permute(x, idx, probs)[0], want_rows)
    for twin in twins:
        fired = []
        twin.register_wgrad_hook(lambda name, q: fired.append(name))
        y = twin(x, idx, probs)
        y.backward(dy)
        assert torch.equal(y, want)
        assert sorted(fired) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]


def test_torch_compile_of_a_small_model():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(128, 6, device=DEV)
            self.experts = GroupedMLP(128, 64, 6, 2, max_tokens=64)

        def forward(self, x):
            probs, idx = torch.topk(torch.softmax(self.router(x.float()), -1), 2)
            return self.experts(x, idx.to(torch.int32), probs)

    model = Model()
    x = (torch.randn(64, 128, device=DEV) * 0.5).bfloat16()
    eager = model(x)
    compiled = torch.compile(model)
    out = compiled(x)
    assert torch.equal(out, eager)
    out.float().sum().backward()
    assert model.router.weight.grad is not None and model.experts.fc1.weight.grad is not None


def test_experts_without_tokens_and_empty_batch():
    mod, x, _, _ = make(T=5, E=8, k=1, seed=9)
    idx = torch.tensor([[2], [2], [5], [2], [5]], dtype=torch.int32, device=DEV)
    probs = torch.rand(5, 1, device=DEV)
    ours, ref = run_both(mod, x, idx, probs)
    for name in ref:
        assert rel_err(ours[name], ref[name]) < 2e-2, name
    assert torch.count_nonzero(ours["fc1.weight"][0]) == 0  # expert 0 got no token: zero gradient
    empty = mod(x[:0], idx[:0], probs[:0])
    assert empty.shape == (0, 128)


def test_bad_input_raises_with_the_argument_name():
    mod, x, idx, probs = make()
    with pytest.raises(ValueError, match="x"):
        mod(x.float(), idx, probs)
    with pytest.raises(ValueError, match="max_tokens"):
        mod(torch.cat([x, x]), torch.cat([idx, idx]), torch.cat([probs, probs]))
    with pytest.raises(ValueError, match="ffn"):
        GroupedMLP(128, 60, 6, 2, max_tokens=8)
    bad = idx.clone()
    bad[0, 0] = 99
    mod(x, bad, probs)
    with pytest.raises(ValueError, match="out of range"):
        mod.check_errors()
    mod.check_errors()  # cleared


def test_integers_past_32_bits_are_refused_by_name():
    # Python ints reach the library's 32-bit fields checked, not wrapped (2^32 + 2 would be 2).
    big = 2**32 + 2
    with pytest.raises(ValueError, match="'topk'"):
        GroupedMLP(128, 64, 8, big, max_tokens=8)
    with pytest.raises(ValueError, match="'num_experts'"):
        GroupedMLP(128, 64, big, 2, max_tokens=8)
    with pytest.raises(ValueError, match="'token_chunks'"):
        GroupedMLP(128, 64, 8, 2, max_tokens=8, token_chunks=big)
    with pytest.raises(ValueError, match="'topk'"):
        Router(8, big, max_tokens=8)
    with pytest.raises(ValueError, match="'scaling_factor'"):
        Router(8, 2, max_tokens=8, scaling_factor=1e300)
    with pytest.raises(ValueError, match="'align'"):
        Dispatcher(8, 8, 128, topk=2, align=big)


def test_write_mode_hooks_fire_once_gradients_are_accumulated():
    mod, x, idx, probs = make(bias=True, seed=17)
    seen = []
    mod.register_wgrad_hook(lambda name, q: seen.append((name, q.grad is not None)))
    mod(x, idx, probs).backward(output_grad(x))
    assert sorted(n for n, _ in seen) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert all(has_grad for _, has_grad in seen)


def test_bad_input_found_as_a_new_user_names_the_argument():
    mod, x, idx, probs = make(T=8, seed=19)
    with pytest.raises(ValueError, match="'x'"):
        mod(x.reshape(1, 1, 1, 8, 128), idx, probs)  # 5-D
    with pytest.raises(ValueError, match="'routing'"):
        mod(x, idx.to(torch.int16), probs)
    with pytest.raises(ValueError, match="'x'"):
        mod(x[0], idx, probs)  # 1-D
    empty = mod(x[:0], torch.empty(0, 2, dtype=torch.int32, device=DEV), torch.empty(0, 2, device=DEV))
    assert empty.shape == (0, 128)
    # Ordinary slices of the routing (4-byte aligned, not 16) are valid input.
    big_idx, big_probs = torch.cat([idx[:1], idx]), torch.cat([probs[:1], probs])
    y_slice = mod(x, big_idx[1:], big_probs[1:])
    assert torch.equal(y_slice, mod(x, idx, probs))


def test_a_refused_call_changes_no_micro_batch_in_flight():
    mod, x, idx, probs = make(seed=13)
    dy = output_grad(x)
    xr = x.clone().requires_grad_()
    y = mod(xr, idx, probs)
    with pytest.raises(ValueError):
        mod(x.float(), idx, probs)  # refused
    y.backward(dy)
    alone = x.clone().requires_grad_()
    y2 = mod(alone, idx, probs)
    y2.backward(dy)
    assert torch.equal(y, y2) and torch.equal(xr.grad, alone.grad)


def test_saved_state_consumed_twice_or_foreign_raises():
    mod, x, idx, probs = make(seed=23)
    other, _, _, _ = make(seed=23)
    lists = mod._param_lists()
    y, state, header = torch.ops.moe_engine.mlp_forward(mod._handle, x, idx, probs, *lists, mod._state_bytes)
    grads = mod._grad_buffers()
    dy = output_grad(x)
    # x is read again only in recompute mode and with save_x_perm=False.
    x_again, x_wrong = (x, None) if mod.reads_x else (None, x)
    with pytest.raises(ValueError, match="another op"):
        torch.ops.moe_engine.mlp_backward(other._handle, state, header, x_again, dy, 2, *other._grad_buffers())
    with pytest.raises(ValueError, match="'x'"):
        torch.ops.moe_engine.mlp_backward(mod._handle, state, header, x_wrong, dy, 2, *grads)
    torch.ops.moe_engine.mlp_backward(mod._handle, state, header, x_again, dy, 2, *grads)
    with pytest.raises(ValueError, match="consumed"):
        torch.ops.moe_engine.mlp_backward(mod._handle, state, header, x_again, dy, 2, *grads)


def test_states_offloaded_to_the_host_and_back_still_work():
    """torch.autograd.graph.save_on_cpu moves every saved tensor (the state included) to the host
    and back to new device memory: the backward must follow them, in every mode."""
    dy = None
    for kwargs in (dict(), dict(save_x_perm=False), dict(recompute=True), dict(bias=True, probs_at_combine=True)):
        mod, x, idx, probs = make(seed=29, **kwargs)
        dy = output_grad(x)
        xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y = mod(xr, idx, probs=pr)
        y.backward(dy)
        want = (y.detach().clone(), xr.grad.clone(), pr.grad.clone(), mod.fc1.weight.grad.clone())
        mod.zero_grad(set_to_none=True)
        xo, po = x.clone().requires_grad_(), probs.clone().requires_grad_()
        with torch.autograd.graph.save_on_cpu():
            yo = mod(xo, idx, probs=po)
        yo.backward(dy)
        got = (yo.detach(), xo.grad, po.grad, mod.fc1.weight.grad)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), kwargs


def test_fp8_block_close_to_bf16_and_weights_refreshed_on_request():
    """fp8="block": every output and gradient within 15% relative L2 of the bf16 module on the same
    data (E4M3 rounding of up to four quantized operands on each path gives ~6%; a wrong scale or
    copy ~100%), graph-free eager; with fp8_weight_refresh="on_request" a forward needs a refresh
    after the weights change, and the refreshed results equal those of every_forward bitwise."""
    T, H, F, E, k = 256, 256, 384, 4, 2
    runs = {}
    for name, kw in (("bf16", {}), ("fp8", {"fp8": "block"}),
                     ("fp8_req", {"fp8": "block", "fp8_weight_refresh": "on_request"})):
        mod, x, idx, probs = make(T, H, F, E, k, seed=3, bias=True, align=128, **kw)
        if name == "fp8_req":
            with pytest.raises(ValueError, match="refresh_fp8_weights"):
                mod(x, idx, probs)
            mod.refresh_fp8_weights()
        dy = output_grad(x)
        xr = x.detach().clone().requires_grad_()
        pr = probs.detach().clone().requires_grad_()
        y = mod(xr, idx, pr)
        y.backward(dy)
        runs[name] = {"y": y, "dx": xr.grad, "dprobs": pr.grad,
                      **{n: p.grad for n, p in mod.named_parameters()}}
        mod.check_errors()
    assert runs["fp8"]["y"].dtype == torch.bfloat16
    for key, want in runs["bf16"].items():
        err = rel_err(runs["fp8"][key], want)
        assert err <= 0.15, (key, err)
        assert torch.equal(runs["fp8"][key], runs["fp8_req"][key]), key
    with pytest.raises(ValueError, match="fp8"):
        GroupedMLP(H, F, E, k, max_tokens=T, fp8="e5m2")
    with pytest.raises(ValueError, match="align"):
        GroupedMLP(H, F, E, k, max_tokens=T, fp8="block", align=64)


@pytest.mark.parametrize("per_expert_weights", [False, True])
def test_parameters_moved_between_forward_and_backward_are_bound_again(per_expert_weights):
    # FSDP resharding after the forward (or ZeRO-3) gathers the parameters again for the backward, at
    # other addresses: the backward binds them there (the same binding) instead of reading where the
    # forward bound them. Bitwise the gradients of a backward whose parameters stayed.
    mod, x, idx, probs = make(seed=21, per_expert_weights=per_expert_weights)
    dy = output_grad(x)
    results = []
    for move in (False, True):
        xr = x.clone().requires_grad_()
        mod.zero_grad(set_to_none=True)
        y = mod(xr, idx, probs)
        if move:
            with torch.no_grad():
                for q in mod.parameters():
                    old = q.data
                    q.data = old.clone()  # the same values at another address
                    old.fill_(float("nan"))  # what the backward would read at the old one
        y.backward(dy)
        results.append((xr.grad, [q.grad.clone() for q in mod.parameters()]))
    assert torch.equal(results[1][0], results[0][0])
    assert all(torch.equal(a, b) for a, b in zip(results[1][1], results[0][1]))
    # The experts-only module does the same.
    ex = GroupedExperts(128, 64, 6, 96, per_expert_weights=per_expert_weights)
    offsets = torch.tensor([0, 10, 10, 30, 50, 60, 96], dtype=torch.int32, device=DEV)
    rows = (torch.randn(96, 128, device=DEV) * 0.5).bfloat16()
    probs_perm = torch.rand(96, device=DEV)
    grads = []
    for move in (False, True):
        r = rows.clone().requires_grad_()
        Y = ex(r, offsets, probs_perm)
        if move:
            with torch.no_grad():
                for q in ex.parameters():
                    old = q.data
                    q.data = old.clone()
                    old.fill_(float("nan"))
        Y.float().sum().backward()
        grads.append(r.grad)
    assert torch.equal(grads[1], grads[0])


def test_fp32_x_under_bf16_autocast_and_bf16_probs():
    # Under a bf16 autocast an fp32 x is cast, as autocast casts a linear's input; bf16 probs (a router's
    # output) are widened exactly. Bitwise the bf16 x / fp32 probs call, the gradients in the inputs'
    # dtypes. Outside an autocast an fp32 x is refused by name.
    mod, x, idx, probs = make(seed=23)
    probs = probs.bfloat16()
    dy = output_grad(x)
    results = []
    for autocast, xin, pin in ((False, x, probs.float()), (True, x.float(), probs)):
        xr, pr = xin.clone().requires_grad_(), pin.clone().requires_grad_()
        mod.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = mod(xr, idx, pr)
        y.backward(dy)
        results.append((y.detach(), xr.grad, pr.grad, [q.grad.clone() for q in mod.parameters()]))
    (y0, dx0, dp0, g0), (y1, dx1, dp1, g1) = results
    assert y1.dtype == torch.bfloat16 and torch.equal(y1, y0)
    assert dx1.dtype == torch.float32 and torch.equal(dx1, dx0.float())
    assert dp1.dtype == torch.bfloat16 and torch.equal(dp1, dp0.bfloat16())
    assert all(torch.equal(a, b) for a, b in zip(g1, g0))
    with pytest.raises(ValueError, match="'x'"):
        mod(x.float(), idx, probs)


def test_grouped_experts_fp32_rows_under_bf16_autocast_and_fp16_probs():
    # The experts-only module takes the same inputs: fp32 rows under a bf16 autocast (cast), fp16 probs
    # (widened exactly): bitwise the bf16 / fp32 call.
    ex = GroupedExperts(128, 64, 6, 96)
    offsets = torch.tensor([0, 10, 10, 30, 50, 60, 96], dtype=torch.int32, device=DEV)
    rows = (torch.randn(96, 128, device=DEV) * 0.5).bfloat16()
    probs = torch.rand(96, device=DEV).half()
    want = ex(rows, offsets, probs.float())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = ex(rows.float(), offsets, probs)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("per_expert_weights", [False, True])
def test_fsdp2_resharding_after_forward(per_expert_weights):
    # PyTorch FSDP2 (fully_shard, one rank) frees the gathered parameters after the forward and
    # gathers them again for the backward: the backward binds them where they are now
    # (rebind_weights). The same output and gradients as the module without FSDP, bitwise.
    from torch.distributed.fsdp import fully_shard
    import socket
    created = not torch.distributed.is_initialized()
    if created:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        plain, x, idx, probs = make(seed=27, per_expert_weights=per_expert_weights)
        sharded, _, _, _ = make(seed=27, per_expert_weights=per_expert_weights)
        sharded.load_state_dict(plain.state_dict())
        fully_shard(sharded, reshard_after_forward=True)
        dy = output_grad(x)
        results = []
        for mod in (plain, sharded):
            xr = x.clone().requires_grad_()
            y = mod(xr, idx, probs)
            y.backward(dy)
            grads = {n: (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad)
                     for n, q in mod.named_parameters()}
            results.append((y.detach(), xr.grad, grads))
        (y0, dx0, g0), (y1, dx1, g1) = results
        assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
        assert g1.keys() == g0.keys()
        for n in g0:
            assert torch.equal(g1[n], g0[n]), n
    finally:
        if created:
            torch.distributed.destroy_process_group()
