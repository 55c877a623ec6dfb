"""MoELayer (gate + fused Router + GroupedMLP as one module): bitwise equal to the same three parts
called one after the other (the same kernels on the same inputs) for every router preset, top-k and
map form (token rounding, the default row bound), [B, S, H] input, the router's losses in the
backward -- except x's gradient where the layer's bf16 gate adds its part into the experts' in one
GEMM (rounded once, where the parts' autograd sum rounds the gate's part first: within a bf16 ulp,
relative L2 error <= 2^-8); against plain PyTorch (gate, softmax, top-k, renormalise, the experts' reference) within
the experts' bf16 tolerance; CUDA graph capture + replay; T = 0; bad arguments.

Tolerance against PyTorch: the layer keeps bf16 intermediates where the reference keeps fp32
(test_grouped_mlp.py): relative L2 error <= 2e-2 (a wrong expert, prob or gradient path gives O(1))."""
import pytest
import torch
import torch.nn.functional as F

from moe_engine import GroupedMLP, MoELayer, Router
from reference import moe_reference, rel_err

DEV = "cuda"
H, FFN = 128, 64

# (router, router options, E, k, GroupedMLP options)
CASES = [
    ("softmax", {}, 8, 2, {}),
    ("mixtral", {}, 8, 2, {}),
    ("qwen3", dict(aux_loss_coeff=1e-2, z_loss_coeff=1e-3), 16, 4, {}),
    ("olmoe", {}, 16, 4, dict(fuse_fc1=False)),
    ("gpt_oss", {}, 8, 2, dict(activation="clamped-swiglu", glu_interleave=1, bias=True)),
    ("deepseek_v3", dict(n_group=4, topk_group=2), 16, 4, {}),
]
PRESETS = {"softmax": Router, "mixtral": Router.mixtral, "qwen3": Router.qwen3, "olmoe": Router.olmoe,
           "gpt_oss": Router.gpt_oss, "deepseek_v3": Router.deepseek_v3}


def inputs(shape, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(*shape, H, device=DEV, generator=g) * 0.5).bfloat16()
    dy = torch.randn(*shape, H, device=DEV, generator=g).bfloat16()
    return x, dy


def step(x, dy, forward, params):
    """Forward + backward of y . dy plus the router's losses; the outputs and every gradient."""
    xr = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    y, routed = forward(xr)
    ((y * dy).sum() + routed.aux_loss + routed.seq_aux_loss + routed.z_loss).backward()
    out = {"y": y, "probs": routed.probs, "counts": routed.counts, "dx": xr.grad}
    out["routing"] = routed.map if routed.indices is None else routed.indices
    out.update({f"grad{i}": p.grad for i, p in enumerate(params)})
    return out


def layer_params(layer):
    return [p for _, p in sorted(layer.named_parameters())]


def grad_key(layer, name):
    """step()'s key of the gradient of the layer's parameter `name`."""
    return f"grad{[n for n, _ in sorted(layer.named_parameters())].index(name)}"


def parts_like(layer, name, ropts, E, k, T, eopts):
    """The layer's gate, router and experts as separate modules with the same parameters and buffers;
    returns forward(x) -> (y, RouterOutput) and its parameters in the layer's order."""
    router = PRESETS[name](E, k, T, **ropts).to(DEV)
    router.load_state_dict(layer.router.state_dict())
    experts = GroupedMLP(H, FFN, E, k, T, map_routing=router.map_output, **eopts)
    experts.load_state_dict(layer.experts.state_dict())
    gate = {n: p.detach().clone().requires_grad_() for n, p in layer.gate.named_parameters()}
    dtype = layer.logits_dtype

    def forward(x):
        x2d = x.reshape(-1, H)
        w, b = gate["weight"], gate.get("bias")
        if dtype is not None and dtype != x2d.dtype:
            logits = F.linear(x2d.to(dtype), w.to(dtype), b.to(dtype) if b is not None else None)
        else:
            logits = F.linear(x2d, w, b)
        routed = router(logits)
        routing = routed.map if routed.indices is None else routed.indices
        return experts(x2d, routing, routed.probs).reshape(x.shape), routed

    named = dict(experts.named_parameters(prefix="experts"))
    named.update({f"gate.{n}": p for n, p in gate.items()})
    return forward, [named[n] for n, _ in sorted(layer.named_parameters())]


def expect_bitwise(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if a[key] is None or b[key] is None:
            assert a[key] is None and b[key] is None, key
        else:
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name,ropts,E,k,eopts", CASES, ids=[c[0] for c in CASES])
def test_equals_its_parts(name, ropts, E, k, eopts):
    torch.manual_seed(0)
    T = 64
    layer = MoELayer(H, FFN, E, k, T, router=name, router_options=ropts, **eopts)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.uniform_(-0.05, 0.05)
    if layer.gate.bias is not None:
        with torch.no_grad():
            layer.gate.bias.normal_(0.0, 0.1)
    assert layer.logits_dtype == (torch.float32 if name == "deepseek_v3" else None)
    assert (layer.gate.bias is not None) == (name == "gpt_oss")
    forward, params = parts_like(layer, name, ropts, E, k, T, eopts)
    x, dy = inputs((4, 16), seed=1)  # [B, S, H]: 64 tokens
    ours = step(x, dy, layer, layer_params(layer))
    theirs = step(x, dy, forward, params)
    assert ours["y"].shape == x.shape
    assert layer._fused_gate() == (name != "deepseek_v3")  # DeepSeek-V3's gate runs in fp32
    if layer._fused_gate():
        assert rel_err(ours.pop("dx"), theirs.pop("dx")) <= 2 ** -8
    expect_bitwise(ours, theirs)
    for key, value in ours.items():
        if key.startswith("grad") or key == "dx":
            assert value is not None and bool(torch.isfinite(value.float()).all()), key
    assert float(ours[grad_key(layer, "gate.weight")].float().abs().sum()) > 0, "no gradient reached the gate"
    keys = set(layer.state_dict())
    assert {"gate.weight", "experts.fc1.weight", "experts.fc2.weight"} <= keys
    assert ("router.expert_bias" in keys) == (name == "deepseek_v3")


def test_gate_with_a_hook_runs_as_a_module():
    # A forward hook on the gate (an adapter, an activation probe) must see the gate run: the layer
    # then calls it as a module, and x's gradient is the parts' autograd sum, bitwise.
    torch.manual_seed(0)
    layer = MoELayer(H, FFN, 16, 4, 64, router="qwen3")
    seen = []
    layer.gate.register_forward_hook(lambda mod, inputs, out: seen.append(out.shape))
    assert not layer._fused_gate()
    forward, params = parts_like(layer, "qwen3", {}, 16, 4, 64, {})
    x, dy = inputs((64,), seed=3)
    ours = step(x, dy, layer, layer_params(layer))
    assert seen == [torch.Size([64, 16])]
    expect_bitwise(ours, step(x, dy, forward, params))


def test_matches_plain_pytorch():
    # qwen3 routing with fp32 logits (no ties in practice): gate, softmax over E, top-k, renormalise,
    # then the experts' reference; outputs, the routing and every gradient.
    torch.manual_seed(2)
    T, E, k = 96, 16, 4
    layer = MoELayer(H, FFN, E, k, T, router="qwen3", logits_dtype=torch.float32)
    x, dy = inputs((T,), seed=3)
    ours = step(x, dy, layer, layer_params(layer))

    w = layer.gate.weight.detach().float().requires_grad_()
    w1 = layer.experts.fc1.weight.detach().clone().requires_grad_()
    w2 = layer.experts.fc2.weight.detach().clone().requires_grad_()
    xr = x.detach().float().requires_grad_()
    top = torch.softmax(F.linear(xr, w), -1).topk(k, dim=-1)
    probs = top.values / top.values.sum(-1, keepdim=True)
    idx = top.indices.to(torch.int32)
    y = moe_reference(xr, idx, probs, w1, w2)
    y.backward(dy.float())

    assert torch.equal(ours["routing"].sort(-1).values, idx.sort(-1).values)
    ref = {"y": y, "dx": xr.grad, grad_key(layer, "gate.weight"): w.grad,
           grad_key(layer, "experts.fc1.weight"): w1.grad, grad_key(layer, "experts.fc2.weight"): w2.grad}
    for key, value in ref.items():
        assert rel_err(ours[key], value) < 2e-2, (key, rel_err(ours[key], value))


def test_map_form_with_token_rounding():
    # "nearest" rounds each expert's count to a multiple of 16, adding candidates where it rounds
    # up: map-form routing, whose row bound the layer sets itself (T k + E (tile - 1)).
    torch.manual_seed(4)
    T, E, k, tile = 200, 8, 2, 16
    ropts = dict(rounding="nearest", rounding_tile=tile, output_form="map")
    layer = MoELayer(H, FFN, E, k, T, router="qwen3", router_options=ropts)
    forward, params = parts_like(layer, "qwen3", ropts, E, k, T, dict(row_bound=T * k + E * (tile - 1)))
    x, dy = inputs((T,), seed=5)
    ours = step(x, dy, layer, layer_params(layer))
    expect_bitwise(ours, step(x, dy, forward, params))
    assert ours["routing"].dtype == torch.bool and ours["probs"].shape == (T, E)
    assert int(ours["counts"].sum()) <= T * k + E * (tile - 1)


def test_graph_replay_equals_eager():
    torch.manual_seed(6)
    T, E, k = 128, 16, 4
    layer = MoELayer(H, FFN, E, k, T, router="mixtral")
    params = layer_params(layer)
    static_x, static_dy = inputs((T,), seed=7)
    static_x.requires_grad_()

    def captured_step():
        static_x.grad = None
        layer.zero_grad(set_to_none=True)
        y, routed = layer(static_x)
        ((y * static_dy).sum() + routed.aux_loss).backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            captured_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = captured_step()
    # The tensors the graph writes (the eager steps below give the parameters new .grad tensors).
    dx_static, grads_static = static_x.grad, [p.grad for p in params]
    for seed in (8, 9):
        x, dy = inputs((T,), seed=seed)
        with torch.no_grad():
            static_x.copy_(x)
            static_dy.copy_(dy)
        graph.replay()
        replayed = {"y": y_static.clone(), "dx": dx_static.clone()}
        replayed.update({f"grad{i}": g.clone() for i, g in enumerate(grads_static)})
        eager = step(x, dy, layer, params)
        for key, value in replayed.items():
            assert torch.equal(value, eager[key]), (seed, key)


def test_zero_tokens():
    layer = MoELayer(H, FFN, 8, 2, 32, router="mixtral")
    x = torch.zeros(0, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    y, routed = layer(x)
    assert y.shape == (0, H) and routed.indices.shape == (0, 2)
    y.sum().backward()
    assert x.grad.shape == (0, H)


def test_bad_arguments():
    with pytest.raises(ValueError, match="argument 'router'"):
        MoELayer(H, FFN, 8, 2, 32, router="switch")
    with pytest.raises(ValueError, match="argument 'map_routing'"):
        MoELayer(H, FFN, 8, 2, 32, map_routing=True)
    with pytest.raises(ValueError, match="argument 'logits_dtype'"):
        MoELayer(H, FFN, 8, 2, 32, logits_dtype=torch.float16)
    layer = MoELayer(H, FFN, 8, 2, 32)
    with pytest.raises(ValueError, match="argument 'x'"):
        layer(torch.zeros(4, H + 8, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="argument 'x'"):
        layer(torch.zeros(4, H, device=DEV))


@pytest.mark.parametrize("router", ["qwen3", "deepseek_v3"])
def test_fp32_input_under_bf16_autocast(router):
    # Under a bf16 autocast an fp32 x (a norm's output) is cast at the layer's entry, as autocast casts
    # a linear's input: the same outputs and gradients as the bf16 x, bitwise, the input gradient in
    # fp32; DeepSeek-V3's fp32 gate stays fp32 under the autocast (its logits would otherwise be bf16).
    ropts = dict(n_group=4, topk_group=2) if router == "deepseek_v3" else {}
    layer = MoELayer(H, FFN, 16, 4, 64, router=router, router_options=ropts)
    x, dy = inputs((2, 24), seed=41)
    want = step(x, dy, layer, layer_params(layer))

    def under_autocast(xr):  # the forward under the autocast, the backward after it (as recommended)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return layer(xr)
    got = step(x.float(), dy, under_autocast, layer_params(layer))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = layer.logits(x.reshape(-1, H))
    assert got["dx"].dtype == torch.float32
    for key, value in want.items():
        if key == "dx":
            value = value.float()
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
    assert logits.dtype == (torch.float32 if router == "deepseek_v3" else torch.bfloat16)
