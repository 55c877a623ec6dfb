"""Framework integrations (docs/integrations.md).

Hugging Face transformers 5.x (skipped without it): the registered "moe_engine" experts function on
the experts modules of Qwen3-MoE, Mixtral, OLMoE and DeepSeek-V3 blocks (and a not-gated ReLU^2
experts class, NemotronH's form) against transformers' own "grouped_mm" and an fp32 eager
reference (the class's own forward on an fp32 copy of the module): output and every gradient
(hidden states, routing weights, gate_up_proj / up_proj, down_proj, biases); the weights the op
reads are the module's own tensors (addresses, and an in-place change seen by the next call);
expert-parallel sentinels; T changing between calls, growing the layer while an older forward is
in flight; the blocks and a whole model switched with experts_implementation="moe_engine". GPT-OSS's experts
are transposed in transformers 5.17 (gate_up_proj [E, H, 2F], alternating gate / up columns,
biases, clamped SwiGLU) and are read in that orientation, in place. fp32 weights run under a
bf16 autocast (bitwise the bf16 model's results) and raise ValueError without it; dense [T, E]
routing weights are gathered at each slot.

Megatron (no megatron-core needed: a duck-typed config): MegatronGroupedMLP against a plain PyTorch
per-expert reference and against GroupedExperts on the same permuted rows, main_grad accumulation
with and without Megatron DDP's placeholder gradients, delayed wgrad with both hook kinds in order,
and state dicts grouped <-> per-expert <-> SequentialMLP, optimizer state included.

Tolerances: moe_engine keeps bf16 intermediates (h, act) where the fp32 reference keeps fp32, so
results differ by a few bf16 roundings: relative L2 error <= 2e-2 against the fp32 reference (a
wrong index, prob, bias or gate layout gives O(1)); against grouped_mm, which rounds differently in
bf16 too, the two budgets add: <= 4e-2."""
import copy
import types

import pytest
import torch
import torch.nn.functional as F

from reference import rel_err

DEV = "cuda"
REF_TOL = 2e-2
PEER_TOL = 4e-2


def random_routing(T, E, k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    probs, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV, generator=g), -1), k, dim=-1)
    return idx, probs


# =============================================================================================
# Hugging Face transformers


def _transformers():
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("needs transformers 5.x")
    import moe_engine.integrations.transformers as hf
    return transformers, hf


def _init_params(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                p.normal_(0.0, 0.5)  # biases: non-zero, so that adding them is tested


H, FFN, E, K = 128, 64, 8, 2
# The FFN size of the transposed (x @ W) and clamped families: 2 F != H, so that no gate_up is square and
# a reading that confused H with 2F would not pass.
FFN_NARROW = 48

# (module, config class, block class), config kwargs
FAMILIES = {
    "qwen3_moe": (("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock"),
                  dict(num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, moe_intermediate_size=FFN)),
    "mixtral": (("mixtral", "MixtralConfig", "MixtralSparseMoeBlock"),
                dict(num_local_experts=E, num_experts_per_tok=K, intermediate_size=FFN)),
    "olmoe": (("olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock"),
              dict(num_experts=E, num_experts_per_tok=K, intermediate_size=FFN)),
    "deepseek_v3": (("deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE"),
                    dict(n_routed_experts=E, num_experts_per_tok=K, n_group=2, topk_group=1, n_shared_experts=1,
                         norm_topk_prob=True, routed_scaling_factor=2.5, moe_intermediate_size=FFN,
                         intermediate_size=2 * FFN)),
    "gpt_oss": (("gpt_oss", "GptOssConfig", "GptOssMLP"),
                dict(num_local_experts=E, num_experts_per_tok=K, intermediate_size=FFN_NARROW)),
}


def hf_block(family, seed=0):
    import importlib
    _transformers()
    (mod_name, cfg_name, block_name), kwargs = FAMILIES[family]
    mod = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
    cfg_mod = importlib.import_module(f"transformers.models.{mod_name}.configuration_{mod_name}")
    config = getattr(cfg_mod, cfg_name)(hidden_size=H, **kwargs)
    block = getattr(mod, block_name)(config).to(DEV, torch.bfloat16)
    _init_params(block, seed)
    return block, config


class Relu2Config(types.SimpleNamespace):
    pass


def relu2_experts(seed=0):
    """A not-gated experts class in NemotronH's form (up_proj [E, F, H], relu2), decorated like the
    library's classes."""
    _transformers()
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_gate=False, has_bias=True)
    class Relu2Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            self.up_proj = torch.nn.Parameter(torch.empty(E, FFN, H))
            self.up_proj_bias = torch.nn.Parameter(torch.empty(E, FFN))
            self.down_proj = torch.nn.Parameter(torch.empty(E, H, FFN))
            self.down_proj_bias = torch.nn.Parameter(torch.empty(E, H))
            self.act_fn = ACT2FN["relu2"]

        def forward(self, hidden_states, top_k_index, top_k_weights):  # the fp32 eager reference
            out = torch.zeros_like(hidden_states)
            for e in range(self.num_experts):
                tok, slot = (top_k_index == e).nonzero(as_tuple=True)
                h = self.act_fn(F.linear(hidden_states[tok], self.up_proj[e], self.up_proj_bias[e]))
                y = F.linear(h, self.down_proj[e], self.down_proj_bias[e]) * top_k_weights[tok, slot, None]
                out = out.index_add(0, tok, y.to(out.dtype))
            return out

    experts = Relu2Experts(Relu2Config(_experts_implementation="eager")).to(DEV, torch.bfloat16)
    _init_params(experts, seed)
    return experts


# Experts classes with a clamped gate: (module, config class, experts class), config kwargs.
CLAMPED_EXPERTS = {
    "deepseek_v4": (("deepseek_v4", "DeepseekV4Config", "DeepseekV4Experts"),
                    dict(n_routed_experts=E, moe_intermediate_size=FFN_NARROW)),
    "glm5_next": (("glm5_next", "Glm5NextTextConfig", "Glm5NextTextExperts"),
                  dict(n_routed_experts=E, moe_intermediate_size=FFN_NARROW)),
    "hy_v4": (("hy_v4", "HYV4Config", "HYV4Experts"), dict(n_routed_experts=E, moe_intermediate_size=FFN_NARROW)),
    "minimax_m3_vl": (("minimax_m3_vl", "MiniMaxM3VLTextConfig", "MiniMaxM3VLExperts"),
                      dict(num_local_experts=E, intermediate_size=FFN_NARROW, swiglu_alpha=1.702)),
    # GPT-OSS's layout (x @ W, biases) with [gate | up] halves; its limit is a module attribute.
    "openai_privacy_filter": (("openai_privacy_filter", "OpenAIPrivacyFilterConfig", "OpenAIPrivacyFilterExperts"),
                              dict(num_local_experts=E, intermediate_size=FFN_NARROW)),
}


def clamped_experts(case, seed=0, limit=7.0):
    import importlib
    _transformers()
    (mod_name, cfg_name, cls_name), kwargs = CLAMPED_EXPERTS[case]
    mod = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
    cfg_mod = importlib.import_module(f"transformers.models.{mod_name}.configuration_{mod_name}")
    config = getattr(cfg_mod, cfg_name)(hidden_size=H, swiglu_limit=limit, **kwargs)
    experts = getattr(mod, cls_name)(config).to(DEV, torch.bfloat16)
    if case == "openai_privacy_filter":
        experts.limit = limit
    _init_params(experts, seed)
    return experts


def experts_of(case, seed=0):
    if case == "relu2":
        return relu2_experts(seed)
    block, _ = hf_block(case, seed)
    return block.experts


def hf_params(experts):
    return {n: p for n, p in experts.named_parameters()}


def run_experts(fn, experts, x, idx, w, dy):
    """Output and every gradient of fn(experts, x, idx, w) backpropagated from dy."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    y = fn(experts, x, idx, w)
    y.backward(dy.to(y.dtype))
    out = {"y": y.detach(), "d_hidden": x.grad, "d_weights": w.grad}
    out.update({f"d_{n}": p.grad for n, p in hf_params(experts).items()})
    return out


def fp32_eager(experts):
    ref = copy.deepcopy(experts).float()
    ref.config = copy.deepcopy(experts.config)
    ref.config._experts_implementation = "eager"
    return ref


def eager_call(mod, x, idx, w):
    return mod(x, idx, w)


def compare_to_references(experts, x, idx, w, seed=99, sentinel=None, skip=()):
    """Ours against transformers' grouped_mm path and an fp32 eager reference: the output and every
    gradient, except the ones named in `skip`."""
    from transformers.integrations.moe import grouped_mm_experts_forward
    from moe_engine.integrations.transformers import moe_engine_experts_forward
    dy = torch.randn(x.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed))
    ours = run_experts(moe_engine_experts_forward, experts, x, idx, w, dy)
    peer = run_experts(grouped_mm_experts_forward, experts, x, idx, w, dy)
    ref_idx = idx if sentinel is None else torch.where(sentinel, idx.new_zeros(()), idx)
    ref = run_experts(eager_call, fp32_eager(experts), x.float(), ref_idx, w.float(), dy)
    assert ours["y"].dtype == ours["d_hidden"].dtype == x.dtype and ours["d_weights"].dtype == w.dtype
    for name in ref:
        if name in skip or (sentinel is not None and name == "d_weights"):
            continue  # compared below, slot by slot
        assert ours[name] is not None, name
        assert rel_err(ours[name], ref[name]) < REF_TOL, (name, rel_err(ours[name], ref[name]))
        assert rel_err(ours[name], peer[name]) < PEER_TOL, (name, rel_err(ours[name], peer[name]))
    if sentinel is not None:
        assert torch.count_nonzero(ours["d_weights"][sentinel]) == 0  # a sentinel slot: no gradient
        keep = ~sentinel
        assert rel_err(ours["d_weights"][keep], ref["d_weights"][keep]) < REF_TOL
    else:
        assert rel_err(ours["d_weights"], ref["d_weights"]) < REF_TOL
    return ours


CASES = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "relu2"]


@pytest.mark.parametrize("case", CASES)
def test_hf_experts_match_grouped_mm_and_fp32_eager(case):
    experts = experts_of(case)
    T = 96
    x = (torch.randn(T, H, device=DEV) * 0.5).bfloat16()
    idx, w = random_routing(T, E, K, seed=1)
    compare_to_references(experts, x, idx, w)
    # Routing weights in bf16 (as Qwen3 / OLMoE routers return them): the gradient comes back in bf16.
    compare_to_references(experts, x, idx, w.bfloat16())


@pytest.mark.parametrize("case", CLAMPED_EXPERTS)
def test_hf_clamped_experts_match_grouped_mm_and_fp32_eager(case):
    # Pre-activations spread about 0.7 here. At a limit of 0.3 both clamps bite on most values: the
    # output and the gradients that depend on the forward alone (routing weights, down_proj) are
    # compared. The gradients through the clamp (d_hidden, gate_up_proj) are compared at a limit of
    # 2.0, out in the tails: at 0.3, bf16 rounding moves enough pre-activations across the clamp's
    # edge to change them by several percent on any bf16 path (transformers' own bf16 eager differs
    # from its fp32 eager by 4-7% in d_hidden there).
    T = 96
    x = (torch.randn(T, H, device=DEV) * 0.5).bfloat16()
    idx, w = random_routing(T, E, K, seed=1)
    experts = clamped_experts(case, limit=0.3)
    through_clamp = {"d_hidden", *(f"d_{n}" for n in hf_params(experts) if n.startswith("gate_up"))}
    assert len(through_clamp) >= 2 and any(n.startswith("down") for n in hf_params(experts))
    compare_to_references(experts, x, idx, w, skip=through_clamp)
    compare_to_references(clamped_experts(case, limit=2.0), x, idx, w)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss", "relu2"])
def test_hf_weights_are_read_in_place(case, monkeypatch):
    hf = _transformers()[1]

    class Recorder:
        def __init__(self, real):
            self.real, self.seen = real, []

        def __getattr__(self, name):
            fn = getattr(self.real, name)
            if name != "mlp_forward":
                return fn

            def wrapped(handle, x, routing, probs, w1, b1, w2, b2, nbytes):
                self.seen.append([t.data_ptr() for t in (*w1, *b1, *w2, *b2)])
                return fn(handle, x, routing, probs, w1, b1, w2, b2, nbytes)
            return wrapped

    rec = Recorder(torch.ops.moe_engine)
    monkeypatch.setattr(hf, "_ops", rec)
    experts = experts_of(case, seed=3)
    x = (torch.randn(40, H, device=DEV) * 0.5).bfloat16()
    idx, w = random_routing(40, E, K, seed=4)
    hf.moe_engine_experts_forward(experts, x, idx, w)
    names = {"qwen3_moe": ["gate_up_proj", "down_proj"],
             "gpt_oss": ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"],
             "relu2": ["up_proj", "up_proj_bias", "down_proj", "down_proj_bias"]}[case]
    want = {n: getattr(experts, n).data_ptr() for n in names}
    assert sorted(rec.seen[-1]) == sorted(want.values())
    # An in-place change of the module's weights is what the next call computes with.
    with torch.no_grad():
        experts.down_proj.mul_(-0.5)
    y = hf.moe_engine_experts_forward(experts, x, idx, w)
    ref = fp32_eager(experts)(x.float(), idx, w.float())
    assert rel_err(y, ref) < REF_TOL


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_hf_frozen_experts_compute_dx_and_routing_gradients_only(case, monkeypatch):
    # Experts frozen (as when adapters or the router train around them): the op gets no gradient
    # buffers, so its backward skips the weight gradients; the hidden states' and routing weights'
    # gradients are bitwise those of trainable experts, and no expert parameter gets a gradient.
    hf = _transformers()[1]
    experts = experts_of(case, seed=7)
    T = 48
    x = (torch.randn(T, H, device=DEV) * 0.5).bfloat16()
    idx, w = random_routing(T, E, K, seed=8)
    dy = torch.randn(x.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(9))
    want = run_experts(hf.moe_engine_experts_forward, experts, x, idx, w, dy)
    lists = []

    class Spy:
        def __getattr__(self, name):
            fn = getattr(torch.ops.moe_engine, name)
            if name != "mlp_backward":
                return fn

            def spy(*args):
                lists.append([len(lst) for lst in args[-4:]])
                return fn(*args)
            return spy

    monkeypatch.setattr(hf, "_ops", Spy())
    experts.requires_grad_(False)
    got = run_experts(hf.moe_engine_experts_forward, experts, x, idx, w, dy)
    assert lists == [[0, 0, 0, 0]]
    for name in ("y", "d_hidden", "d_weights"):
        assert torch.equal(got[name], want[name]), name
    assert all(p.grad is None for p in experts.parameters())


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3"])
def test_hf_expert_parallel_sentinels_contribute_nothing(case):
    experts = experts_of(case, seed=5)
    T = 64
    x = (torch.randn(T, H, device=DEV) * 0.5).bfloat16()
    idx, w = random_routing(T, E, K, seed=6)
    sentinel = torch.zeros_like(idx, dtype=torch.bool)
    sentinel[::3, 0] = True
    sentinel[::5, 1] = True
    idx = torch.where(sentinel, torch.full_like(idx, E), idx)  # ids >= E, as transformers' RouterParallel makes
    w = torch.where(sentinel, torch.zeros_like(w), w)  # zero there, as RouterParallel masks them
    compare_to_references(experts, x, idx, w, sentinel=sentinel)
    # Even with a non-zero weight a sentinel slot adds nothing.
    from moe_engine.integrations.transformers import moe_engine_experts_forward
    y1 = moe_engine_experts_forward(experts, x, idx, w)
    y2 = moe_engine_experts_forward(experts, x, idx, torch.where(sentinel, torch.full_like(w, 3.0), w))
    assert torch.equal(y1, y2)


def test_hf_token_count_changes_and_the_layer_grows():
    hf = _transformers()[1]
    experts = experts_of("mixtral", seed=7)
    ref = fp32_eager(experts)
    outs = []
    for T in (48, 17, 300, 0, 5):
        x = (torch.randn(T, H, device=DEV) * 0.5).bfloat16()
        idx, w = random_routing(T, E, K, seed=T)
        y = hf.moe_engine_experts_forward(experts, x, idx, w)
        assert y.shape == (T, H)
        if T:
            assert rel_err(y, ref(x.float(), idx, w.float())) < REF_TOL, T
        outs.append(hf.layer_tokens(experts))
    assert outs == [256, 256, 512, 512, 512]  # grows (next power of two) and never shrinks
    # A forward in flight keeps its layer: a larger call in between, then both backwards.
    xa = (torch.randn(32, H, device=DEV) * 0.5).bfloat16().requires_grad_()
    ia, wa = random_routing(32, E, K, seed=40)
    ya = hf.moe_engine_experts_forward(experts, xa, ia, wa)
    xb = (torch.randn(1500, H, device=DEV) * 0.5).bfloat16().requires_grad_()
    ib, wb = random_routing(1500, E, K, seed=41)
    yb = hf.moe_engine_experts_forward(experts, xb, ib, wb)
    assert hf.layer_tokens(experts) == 2048
    dya = torch.randn_like(ya)
    ya.backward(dya)
    yb.float().sum().backward()
    xr = xa.detach().float().requires_grad_()
    ref(xr, ia, wa.float()).backward(dya.float())
    assert rel_err(xa.grad, xr.grad) < REF_TOL


def test_hf_reserve_before_graph_capture():
    hf = _transformers()[1]
    experts = experts_of("olmoe", seed=8)
    assert hf.reserve(experts, 1000, K) == 1024
    assert hf.layer_tokens(experts) == 1024


def test_hf_gpt_oss_experts_are_transposed_and_checked_in_that_orientation():
    hf = _transformers()[1]
    block, _ = hf_block("gpt_oss")
    experts = block.experts
    assert experts.is_transposed  # transformers 5.17: gate_up_proj [E, H, 2F], down_proj [E, F, H]
    assert tuple(experts.gate_up_proj.shape) == (E, H, 2 * FFN_NARROW)
    spec = hf.describe(experts)
    assert spec.transposed and (spec.hidden, spec.ffn, spec.experts, spec.interleave) == (H, FFN_NARROW, E, 1)
    # A weight in the other orientation is named, not silently misread.
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().transpose(1, 2).contiguous())
    with pytest.raises(ValueError, match=r"down_proj"):
        hf.describe(experts)


def test_hf_non_bf16_weights_raise_naming_the_attribute():
    hf = _transformers()[1]
    experts = experts_of("qwen3_moe").float()
    x = torch.randn(8, H, device=DEV)
    idx, w = random_routing(8, E, K, seed=10)
    with pytest.raises(ValueError, match="gate_up_proj.*bf16.*autocast"):  # fp32 without autocast
        hf.moe_engine_experts_forward(experts, x, idx, w)
    with torch.autocast("cuda", dtype=torch.float16), pytest.raises(ValueError, match="gate_up_proj.*float16.*bf16"):
        hf.moe_engine_experts_forward(experts, x, idx, w)  # an fp16 autocast asks for fp16 compute
    with pytest.raises(ValueError, match="down_proj.*float64"):
        experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().double())
        hf.moe_engine_experts_forward(experts, x, idx, w)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_hf_full_precision_weights_under_bf16_autocast(case):
    """A model kept in fp32 and run under a bf16 autocast: the weights are cast for the call, so the
    output and every gradient are the bf16 model's, bitwise (the fp32 values are bf16 values), in fp32."""
    hf = _transformers()[1]
    experts16 = experts_of(case, seed=11)
    experts32 = copy.deepcopy(experts16).float()
    T = 72
    x = (torch.randn(T, H, device=DEV) * 0.5).bfloat16()
    idx, w = random_routing(T, E, K, seed=12)
    dy = torch.randn(T, H, device=DEV, generator=torch.Generator(device=DEV).manual_seed(13))
    want = run_experts(hf.moe_engine_experts_forward, experts16, x, idx, w, dy)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = run_experts(hf.moe_engine_experts_forward, experts32, x.float(), idx, w, dy)
    for name, ref in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], ref.float()), name
    # The copies belong to the layer object: a second forward in flight, then both backwards in the
    # other order, gives the same gradients (a per-call copy was freed before its backward, and the
    # backward's gradient buffer could take its memory).
    with torch.autocast("cuda", dtype=torch.bfloat16):
        xa = x.float().requires_grad_()
        ya = hf.moe_engine_experts_forward(experts32, xa, idx, w)
        xb = x.float().requires_grad_()
        yb = hf.moe_engine_experts_forward(experts32, xb, idx, w)
    experts32.zero_grad(set_to_none=True)
    yb.backward(dy)
    ya.backward(dy)
    assert torch.equal(xa.grad, want["d_hidden"].float()) and torch.equal(xb.grad, xa.grad)
    assert torch.equal(experts32.down_proj.grad, 2 * want["d_down_proj"].float())


def test_hf_dense_routing_weights_are_gathered_at_each_slot():
    """top_k_weights as a router's dense [T, E] (one weight per expert): the same output as the [T, k]
    weights of the chosen experts, bitwise; the gradient lands on the chosen entries only."""
    hf = _transformers()[1]
    experts = experts_of("mixtral", seed=14)
    T = 50
    x = (torch.randn(T, H, device=DEV) * 0.5).bfloat16()
    idx, w = random_routing(T, E, K, seed=15)
    sentinel = torch.zeros_like(idx, dtype=torch.bool)
    sentinel[::4, 1] = True
    idx = torch.where(sentinel, torch.full_like(idx, E), idx)
    rows, cols = torch.nonzero(~sentinel, as_tuple=True)  # the live slots; a row's experts are distinct
    dense = torch.zeros(T, E, device=DEV)
    dense[rows, idx[rows, cols]] = w[rows, cols]
    dy = torch.randn(T, H, device=DEV, generator=torch.Generator(device=DEV).manual_seed(16))
    want = run_experts(hf.moe_engine_experts_forward, experts, x, idx, torch.where(sentinel, 0.0, w), dy)
    got = run_experts(hf.moe_engine_experts_forward, experts, x, idx, dense, dy)
    for name in want:
        if name != "d_weights":
            assert torch.equal(got[name], want[name]), name
    chosen = torch.zeros(T, E, dtype=torch.bool, device=DEV)
    chosen[rows, idx[rows, cols]] = True
    assert torch.equal(got["d_weights"][rows, idx[rows, cols]], want["d_weights"][rows, cols])
    assert torch.count_nonzero(got["d_weights"][~chosen]) == 0
    with pytest.raises(ValueError, match=r"top_k_weights should be \[T, k\].*or.*\[T, E\]"):
        hf.moe_engine_experts_forward(experts, x, idx, dense[:, :E - 1])
    with pytest.raises(ValueError, match="top_k_index should hold integer expert ids"):
        hf.moe_engine_experts_forward(experts, x, idx.float(), w)  # would have been truncated silently
    # int32 ids (gather wants int64): the same result.
    assert torch.equal(hf.moe_engine_experts_forward(experts, x, idx.int(), dense), got["y"])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"])
def test_hf_block_with_experts_implementation_moe_engine(family):
    block, config = hf_block(family, seed=11)
    x = (torch.randn(2, 40, H, device=DEV) * 0.5).bfloat16()
    dy = torch.randn_like(x)
    results = {}
    for impl in ("grouped_mm", "moe_engine"):
        config._experts_implementation = impl
        xr = x.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        out = block(xr)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dy)
        results[impl] = {"y": out.detach(), "dx": xr.grad}
        results[impl].update({n: p.grad for n, p in block.named_parameters() if p.grad is not None})
    assert results["moe_engine"].keys() == results["grouped_mm"].keys()
    for name, want in results["grouped_mm"].items():
        assert rel_err(results["moe_engine"][name], want) < PEER_TOL, (name, rel_err(results["moe_engine"][name], want))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_hf_fp32_block_under_bf16_autocast(family):
    """A whole block kept in fp32 and trained under a bf16 autocast (the router in autocast's bf16
    matmuls, the experts on moe_engine with their weights cast per call) against the
    block's eager experts under the same autocast (the same routing; their linears cast by autocast):
    within the bf16 budget; every parameter gets an fp32 gradient."""
    block, config = hf_block(family, seed=17)
    block.float()
    x = torch.randn(2, 40, H, device=DEV) * 0.5
    dy = torch.randn_like(x)
    results = {}
    for impl in ("eager", "moe_engine"):
        config._experts_implementation = impl
        xr = x.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = block(xr)
            out = out[0] if isinstance(out, tuple) else out
        out.float().backward(dy)
        results[impl] = {"y": out.detach().float(), "dx": xr.grad}
        results[impl].update({n: p.grad for n, p in block.named_parameters() if p.grad is not None})
    assert results["moe_engine"].keys() == results["eager"].keys()
    for name, want in results["eager"].items():
        got = results["moe_engine"][name]
        assert got.dtype == torch.float32, name
        assert rel_err(got, want) < PEER_TOL, (name, rel_err(got, want))


# The FP8 recipe against the fp32 eager experts: E4M3 rounding of up to four quantized operands on each
# path, 5.5-6.7% relative L2 measured on the C++ layer against bf16 (docs/layer.md, FP8 experts); a scale
# on the wrong block or a copy of the wrong tensor shows as tens of percent.
FP8_REF_TOL = 0.15


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral", "deepseek_v3", "relu2"])
def test_hf_experts_fp8_are_grouped_mlp_fp8_on_the_modules_weights(case):
    """"moe_engine_fp8" computes what GroupedMLP(fp8="block") computes on the module's weights (the same
    configuration: unfused path, 128-row alignment), output and every gradient bit for bit, and stays
    within the recipe's error of the fp32 eager experts."""
    from moe_engine import GroupedMLP
    hf = _transformers()[1]
    experts = experts_of(case)
    spec = hf.describe(experts)
    T = 96
    x = (torch.randn(T, H, device=DEV) * 0.5).bfloat16()
    idx, w = random_routing(T, E, K, seed=3)
    dy = torch.randn(x.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(4))
    ours = run_experts(hf.moe_engine_fp8_experts_forward, experts, x, idx, w, dy)
    mlp = GroupedMLP(H, spec.ffn, E, K, max_tokens=hf.layer_tokens(experts), activation=spec.activation,
                     glu_interleave=spec.interleave, bias=spec.b1 is not None, clamp_alpha=spec.alpha,
                     clamp_limit=spec.limit, clamp_offset=spec.offset, fp8="block")
    names = {"fc1.weight": spec.w1_name, "fc2.weight": "down_proj", "fc1.bias": spec.b1_name,
             "fc2.bias": "down_proj_bias"}
    params = hf_params(experts)
    with torch.no_grad():
        for n, q in mlp.named_parameters():
            q.copy_(params[names[n]])
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = mlp(xr, idx.int(), wr)
    y.backward(dy.to(y.dtype))
    mlp.check_errors()
    want = {"y": y.detach(), "d_hidden": xr.grad, "d_weights": wr.grad,
            **{f"d_{names[n]}": q.grad for n, q in mlp.named_parameters()}}
    assert ours.keys() == want.keys()
    for name, v in want.items():
        assert ours[name].dtype == v.dtype and torch.equal(ours[name], v), name
    ref = run_experts(eager_call, fp32_eager(experts), x.float(), idx, w.float(), dy)
    for name, v in ref.items():
        assert rel_err(ours[name], v) < FP8_REF_TOL, (name, rel_err(ours[name], v))


def test_hf_fp8_refuses_transposed_experts_and_a_block_runs_by_name():
    hf = _transformers()[1]
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert "moe_engine_fp8" in ALL_EXPERTS_FUNCTIONS
    gpt_oss = experts_of("gpt_oss")
    x = (torch.randn(16, H, device=DEV) * 0.5).bfloat16()
    idx, w = random_routing(16, E, K, seed=5)
    with pytest.raises(NotImplementedError, match="is_transposed"):
        hf.moe_engine_fp8_experts_forward(gpt_oss, x, idx, w)
    block, config = hf_block("qwen3_moe", seed=13)
    config._experts_implementation = "moe_engine_fp8"
    xb = (torch.randn(2, 40, H, device=DEV) * 0.5).bfloat16().requires_grad_()
    out = block(xb)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    assert xb.grad is not None and block.experts.gate_up_proj.grad is not None
    assert hf._layers[block.experts].key[-1] == "block"  # the block ran on an FP8 layer
    with pytest.raises(ValueError, match="fp8"):
        hf.reserve(block.experts, 64, K, fp8="mxfp8")


def test_hf_model_accepts_the_registered_name():
    transformers, hf = _transformers()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert "moe_engine" in ALL_EXPERTS_FUNCTIONS
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m
    config = m.Qwen3MoeConfig(vocab_size=128, hidden_size=H, intermediate_size=2 * FFN, moe_intermediate_size=FFN,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                              num_experts=E, num_experts_per_tok=K)
    torch.manual_seed(12)
    model = m.Qwen3MoeForCausalLM(config).to(DEV, torch.bfloat16)
    _init_params(model, 12)
    ids = torch.randint(0, 128, (2, 24), device=DEV)
    model.set_experts_implementation("grouped_mm")
    want = model(ids).logits
    model.set_experts_implementation("moe_engine")
    assert model.config._experts_implementation == "moe_engine"
    got = model(ids).logits
    assert rel_err(got, want) < PEER_TOL
    got.float().sum().backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


# =============================================================================================
# Megatron


MH, MF, ME = 128, 64, 4


def megatron_config(**over):
    cfg = dict(num_moe_experts=ME, moe_ffn_hidden_size=MF, hidden_size=MH, gated_linear_unit=True,
               activation_func=F.silu, add_bias_linear=True, moe_router_topk=2, gradient_accumulation_fusion=False,
               delay_wgrad_compute=False, moe_apply_probs_on_input=False, moe_mlp_glu_interleave_size=None,
               glu_linear_offset=0.0, activation_func_clamp_value=None, moe_latent_size=None,
               expert_model_parallel_size=1, expert_tensor_parallel_size=1, tensor_model_parallel_size=1)
    cfg.update(over)
    return types.SimpleNamespace(**cfg)


def quick_gelu(x):  # Megatron's megatron.core.activations.quick_gelu, matched by name
    return x * torch.sigmoid(1.702 * x)


def megatron_reference(x, counts, probs, w1, b1, w2, b2, config):
    """Plain PyTorch, fp32, the way TEGroupedMLP computes (bias_act_func's glu, then fc2 + b2 * p)."""
    out, start = [], 0
    s = config.moe_mlp_glu_interleave_size
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe, pe = x[start:start + n].float(), probs[start:start + n].float().unsqueeze(-1)
        h = xe @ w1[e].float().T + b1[e].float()
        if s:
            h = h.reshape(n, -1, 2, s).transpose(1, 2).reshape(n, -1)
        g, lin = h.chunk(2, -1)
        if config.activation_func_clamp_value is not None:
            c = config.activation_func_clamp_value
            g, lin = g.clamp(max=c), lin.clamp(-c, c)
        act = config.activation_func(g) * (lin + config.glu_linear_offset) * pe
        out.append(act @ w2[e].float().T + b2[e].float() * pe)
        start += n
    return torch.cat(out)


def megatron_batch(counts, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    rows = sum(counts)
    x = (torch.randn(rows, MH, device=DEV, generator=g) * 0.5).bfloat16()
    probs = torch.rand(rows, device=DEV, generator=g)
    dy = torch.randn(rows, MH, device=DEV, generator=g).bfloat16()
    return x, torch.tensor(counts, device=DEV), probs, dy


def stacked(mod, owner, what):
    ps = [getattr(getattr(mod, owner), f"{what}{i}") for i in range(mod.num_experts)] if mod.per_expert_weights \
        else [getattr(getattr(mod, owner), what)]
    return torch.stack(ps) if mod.per_expert_weights else ps[0]


def randomize(mod, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, q in mod.named_parameters():
            q.normal_(0.0, 0.5 if ".bias" in n else q.shape[-1] ** -0.5)


@pytest.mark.parametrize("over,per_expert", [
    ({}, True),
    ({"moe_mlp_glu_interleave_size": 32}, False),
    ({"activation_func": quick_gelu, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0}, True),
])
def test_megatron_matches_per_expert_reference_and_grouped_experts(over, per_expert):
    from moe_engine import GroupedExperts
    from moe_engine.integrations.megatron import MegatronGroupedMLP
    config = megatron_config(**over)
    mod = MegatronGroupedMLP(ME, config, max_rows=64, per_expert_weights=per_expert)
    randomize(mod, 1)
    counts = [9, 0, 17, 6]
    x, tpe, probs, dy = megatron_batch(counts, 2)
    xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, bias = mod(xr, tpe, pr)
    assert bias is None
    out.backward(dy)
    params = {f"{o}.{w}": stacked(mod, o, w).detach().float().requires_grad_()
              for o in ("linear_fc1", "linear_fc2") for w in ("weight", "bias")}
    xf, pf = x.float().requires_grad_(), probs.clone().requires_grad_()
    ref = megatron_reference(xf, counts, pf, params["linear_fc1.weight"], params["linear_fc1.bias"],
                             params["linear_fc2.weight"], params["linear_fc2.bias"], config)
    ref.backward(dy.float())
    assert rel_err(out, ref) < REF_TOL
    assert rel_err(xr.grad, xf.grad) < REF_TOL
    assert rel_err(pr.grad, pf.grad) < REF_TOL
    for name, p in params.items():
        o, w = name.split(".")
        grads = ([getattr(getattr(mod, o), f"{w}{i}").grad for i in range(ME)] if per_expert
                 else [getattr(getattr(mod, o), w).grad])
        got = torch.stack(grads) if per_expert else grads[0]
        assert rel_err(got, p.grad) < REF_TOL, name
    # The same op on the same rows: bitwise GroupedExperts with offsets from the host.
    kind = "clamped-swiglu" if "activation_func_clamp_value" in over else "swiglu"
    kw = dict(clamp_alpha=1.702, clamp_limit=7.0, clamp_offset=1.0) if kind == "clamped-swiglu" else {}
    plain = GroupedExperts(MH, MF, ME, 64, activation=kind, glu_interleave=over.get("moe_mlp_glu_interleave_size") or 0,
                           bias=True, **kw)
    with torch.no_grad():
        plain.fc1.weight.copy_(stacked(mod, "linear_fc1", "weight"))
        plain.fc1.bias.copy_(stacked(mod, "linear_fc1", "bias"))
        plain.fc2.weight.copy_(stacked(mod, "linear_fc2", "weight"))
        plain.fc2.bias.copy_(stacked(mod, "linear_fc2", "bias"))
    offsets = torch.tensor([0, 9, 9, 26, 32], dtype=torch.int32, device=DEV)
    assert torch.equal(plain(x, offsets, probs), out.detach())


@pytest.mark.parametrize("per_expert,fp32_scales", [(True, False), (False, False), (True, True)])
def test_megatron_fp8_blockwise_is_grouped_experts_fp8_on_the_128_row_grid(per_expert, fp32_scales, monkeypatch):
    """config.fp8 = "e4m3" with fp8_recipe = "blockwise": the experts run GroupedExperts(fp8="block_pow2")
    -- TransformerEngine's power-of-two scales -- or, with NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1,
    GroupedExperts(fp8="block"), on the call's groups moved onto the 128-row grid (zero rows with zero
    probs between them). The same computed by hand on such a grid gives the output and every gradient
    bit for bit; the bf16 module with the same weights is within the recipe's error (FP8_REF_TOL)."""
    from moe_engine import GroupedExperts
    from moe_engine.integrations.megatron import MegatronGroupedMLP
    if fp32_scales:
        monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    else:
        monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    recipe = "block" if fp32_scales else "block_pow2"
    mod = MegatronGroupedMLP(ME, megatron_config(fp8="e4m3", fp8_recipe="blockwise"), max_rows=64,
                             per_expert_weights=per_expert)
    assert mod.fp8 == recipe and mod.max_rows_on_grid % 128 == 0 and mod.max_rows_on_grid >= 64 + ME * 127
    randomize(mod, 7)
    counts = [9, 0, 17, 6]
    x, tpe, probs, dy = megatron_batch(counts, 8)
    xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, _ = mod(xr, tpe, pr)
    out.backward(dy)
    mod.check_errors()  # no expert's rows off the 128-row grid

    ref = GroupedExperts(MH, MF, ME, mod.max_rows_on_grid, bias=True, fp8=recipe)
    with torch.no_grad():
        for p, o in (("fc1", "linear_fc1"), ("fc2", "linear_fc2")):
            getattr(ref, p).weight.copy_(stacked(mod, o, "weight"))
            getattr(ref, p).bias.copy_(stacked(mod, o, "bias"))
    starts, grid_starts = [0, 9, 9, 26], [0, 128, 128, 256]
    dest = torch.cat([torch.arange(g, g + c) for g, c in zip(grid_starts, counts)]).to(DEV)
    xg = torch.zeros(mod.max_rows_on_grid, MH, device=DEV, dtype=torch.bfloat16)
    xg[dest] = x
    pg = torch.zeros(mod.max_rows_on_grid, device=DEV)
    pg[dest] = probs
    xg.requires_grad_()
    pg.requires_grad_()
    grid = torch.tensor([0, 128, 128, 256, 384], dtype=torch.int32, device=DEV)
    want = ref(xg, grid, pg)[dest]
    want.backward(dy)
    assert torch.equal(out, want)
    assert torch.equal(xr.grad, xg.grad[dest]) and torch.equal(pr.grad, pg.grad[dest])
    for p, o in (("fc1", "linear_fc1"), ("fc2", "linear_fc2")):
        for w in ("weight", "bias"):
            got = (torch.stack([getattr(getattr(mod, o), f"{w}{i}").grad for i in range(ME)]) if per_expert
                   else getattr(getattr(mod, o), w).grad)
            assert torch.equal(got, getattr(getattr(ref, p), w).grad), (o, w)

    bf16 = MegatronGroupedMLP(ME, megatron_config(), max_rows=64, per_expert_weights=per_expert)
    bf16.load_state_dict(mod.state_dict())
    assert rel_err(out, bf16(x, tpe, probs)[0]) < FP8_REF_TOL
    # A call above max_rows is refused by name (the grid would otherwise hold it silently, or not at all).
    with pytest.raises(ValueError, match="max_rows"):
        mod(torch.zeros(65, MH, device=DEV, dtype=torch.bfloat16), torch.tensor([65, 0, 0, 0], device=DEV),
            torch.ones(65, device=DEV))


@pytest.mark.parametrize("over,named", [
    ({"fp8": "e4m3", "fp8_recipe": "delayed"}, "fp8_recipe"),
    ({"fp8": "hybrid", "fp8_recipe": "blockwise"}, "config.fp8 "),
    ({"fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": True}, "fp8_param"),
    ({"fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_wgrad": False}, "fp8_wgrad"),
    ({"fp8": "e4m3", "fp8_recipe": "blockwise", "first_last_layers_bf16": True}, "first_last_layers_bf16"),
    ({"fp4": "nvfp4"}, "fp4"),
])
def test_megatron_fp8_options_other_than_blockwise_e4m3_are_refused_by_name(over, named):
    from moe_engine.integrations.megatron import MegatronGroupedMLP
    with pytest.raises(NotImplementedError, match=named):
        MegatronGroupedMLP(ME, megatron_config(**over), max_rows=64)


def test_megatron_group_offsets_stay_on_the_device():
    from moe_engine.integrations.megatron import group_offsets
    counts = torch.tensor([3, 0, 5, 2], device=DEV)
    g = group_offsets(counts, counts.device)
    assert g.dtype == torch.int32 and g.device == counts.device
    assert g.tolist() == [0, 3, 3, 8, 10]
    assert group_offsets([1, 2], torch.device(DEV)).tolist() == [0, 1, 3]


def ddp_hook(name, q, seen):
    """Megatron DDP's backward post hook, reduced to what concerns the layer: the placeholder
    gradient is dropped (main_grad already holds the sum) and the parameter is ready."""
    def hook(*unused):
        seen.append((name, q.grad_added_to_main_grad))
        q.grad = None
    return hook


def test_megatron_main_grad_accumulation_with_and_without_ddp_flags():
    from moe_engine.integrations.megatron import MegatronGroupedMLP
    base = MegatronGroupedMLP(ME, megatron_config(), max_rows=64)
    randomize(base, 3)
    counts = [5, 7, 0, 11]
    x, tpe, probs, dy = megatron_batch(counts, 4)
    base(x, tpe, probs)[0].backward(dy)
    want = {n: q.grad.float() for n, q in base.named_parameters()}
    for under_ddp in (False, True):
        mod = MegatronGroupedMLP(ME, megatron_config(gradient_accumulation_fusion=True), max_rows=64)
        mod.load_state_dict(base.state_dict())
        start, seen = {}, []
        for n, q in mod.named_parameters():
            q.main_grad = torch.randn(q.shape, device=DEV)
            start[n] = q.main_grad.clone()
            if under_ddp:  # what Megatron's DDP sets, and the hook it puts on each gradient accumulator
                q.grad_added_to_main_grad = False
                acc = q.expand_as(q).grad_fn.next_functions[0][0]
                acc.register_hook(ddp_hook(n, q, seen))
                q._keep_acc = acc
        mod(x, tpe, probs)[0].backward(dy)
        for n, q in mod.named_parameters():
            assert q.grad is None, n
            assert rel_err(q.main_grad - start[n], want[n]) < 1e-2, n
        if under_ddp:
            assert sorted(n for n, _ in seen) == sorted(start) and all(flag for _, flag in seen)
        else:
            assert seen == []


def test_megatron_fp8_blockwise_with_delay_wgrad_compute_is_bitwise_the_immediate_module():
    # FP8 with delayed weight gradients: the backward keeps the FP8 copies of dY and dh the weight
    # gradients read, backward_dw() computes them -- into main_grad, bit for bit what the module
    # without delay adds in its backward, with the same dx and dprobs.
    from moe_engine.integrations.megatron import MegatronGroupedMLP
    counts = [9, 0, 17, 6]
    x, tpe, probs, dy = megatron_batch(counts, 8)
    results = []
    for delay in (False, True):
        config = megatron_config(fp8="e4m3", fp8_recipe="blockwise", gradient_accumulation_fusion=True,
                                 delay_wgrad_compute=delay)
        mod = MegatronGroupedMLP(ME, config, max_rows=64)
        randomize(mod, 7)
        for q in mod.parameters():
            q.main_grad = torch.zeros(q.shape, device=DEV)
        xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out, _ = mod(xr, tpe, pr)
        out.backward(dy)
        if delay:
            assert all(torch.count_nonzero(q.main_grad) == 0 for q in mod.parameters())
            mod.backward_dw()
        mod.check_errors()
        results.append((out, xr.grad, pr.grad, [q.main_grad for q in mod.parameters()]))
    (o0, dx0, dp0, g0), (o1, dx1, dp1, g1) = results
    assert torch.equal(o0, o1) and torch.equal(dx0, dx1) and torch.equal(dp0, dp1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert any(torch.count_nonzero(a) > 0 for a in g0)  # (expert 1 has no rows: its gradients stay zero)


def test_megatron_delayed_wgrad_runs_hooks_in_order():
    from moe_engine.integrations.megatron import MegatronGroupedMLP
    base = MegatronGroupedMLP(ME, megatron_config(), max_rows=64)
    randomize(base, 5)
    counts = [4, 4, 4, 4]
    x, tpe, probs, dy = megatron_batch(counts, 6)
    base(x, tpe, probs)[0].backward(dy)
    mod = MegatronGroupedMLP(ME, megatron_config(gradient_accumulation_fusion=True, delay_wgrad_compute=True),
                             max_rows=64)
    mod.load_state_dict(base.state_dict())
    assert all(q.skip_backward_post_hook for q in mod.parameters())
    for q in mod.parameters():
        q.main_grad = torch.zeros(q.shape, device=DEV)
    order = []
    mod.register_wgrad_hook(lambda name, q: order.append(name))
    # Megatron DDP's registration under delay_wgrad_compute: one hook per parameter, on every module
    # that has the method and holds the parameter -- exactly one here (linear_fc1 / linear_fc2).
    for n, q in mod.named_parameters():
        owners = [m for m in mod.modules() if hasattr(m, "register_wgrad_accumulation_and_reduce_hooks")
                  and any(q is p for p in m.parameters())]
        assert len(owners) == 1, n
        owners[0].register_wgrad_accumulation_and_reduce_hooks(lambda *unused, n=n: order.append("ddp " + n))
    xr = x.clone().requires_grad_()
    mod(xr, tpe, probs)[0].backward(dy)
    assert order == [] and all(torch.count_nonzero(q.main_grad) == 0 for q in mod.parameters())
    mod.backward_dw()
    names = [f"{o}.{w}{i}" for o, w in (("linear_fc2", "weight"), ("linear_fc2", "bias"), ("linear_fc1", "weight"),
                                         ("linear_fc1", "bias")) for i in range(ME)]
    assert order == names + ["ddp " + n for n in names]  # each once, fc2's before fc1's
    for (n, q), (_, b) in zip(mod.named_parameters(), base.named_parameters()):
        assert rel_err(q.main_grad, b.grad.float()) < 1e-2, n


def test_megatron_state_dicts_grouped_per_expert_sequential_and_optimizer_state():
    from moe_engine.integrations.megatron import (MegatronGroupedMLP, grouped_to_sequential_keys,
                                                  normalize_optimizer_state)
    per = MegatronGroupedMLP(ME, megatron_config(), max_rows=32)
    randomize(per, 7)
    sd = per.state_dict()
    assert "linear_fc1.weight0" in sd and "linear_fc2.bias3" in sd  # TEGroupedLinear's names
    grouped = MegatronGroupedMLP(ME, megatron_config(), max_rows=32, per_expert_weights=False)
    grouped.load_state_dict(sd)  # per expert -> grouped
    assert torch.equal(grouped.linear_fc1.weight[2], per.linear_fc1.weight2)
    back = MegatronGroupedMLP(ME, megatron_config(), max_rows=32)
    back.load_state_dict(grouped.state_dict())  # grouped -> per expert
    assert torch.equal(back.linear_fc2.weight1, per.linear_fc2.weight1)
    # TE's single grouped weight stored as [E * out, in].
    flat = {k: (v.reshape(-1, v.shape[-1]) if v.dim() == 3 else v) for k, v in grouped.state_dict().items()}
    again = MegatronGroupedMLP(ME, megatron_config(), max_rows=32, per_expert_weights=False)
    again.load_state_dict(flat)
    assert torch.equal(again.linear_fc1.weight, grouped.linear_fc1.weight)
    # Only exactly [E * out, in] is read that way: fc2 in Hugging Face's orientation [E, F, H] has the
    # element count of [E, H, F] and is refused, not reshaped.
    transposed = dict(grouped.state_dict())
    transposed["linear_fc2.weight"] = transposed["linear_fc2.weight"].transpose(1, 2).contiguous()
    with pytest.raises(RuntimeError, match="size mismatch"):
        again.load_state_dict(transposed)
    # SequentialMLP's spelling, both ways.
    seq = grouped_to_sequential_keys(dict(grouped.state_dict()), "", ME)
    assert "local_experts.2.linear_fc1.weight" in seq and "linear_fc1.weight" not in seq
    # The linears' _extra_state (None from Megatron's local linears, a tensor from TE's) is dropped.
    seq["local_experts.0.linear_fc1._extra_state"] = None
    seq["linear_fc2._extra_state"] = torch.empty(0)
    from_seq = MegatronGroupedMLP(ME, megatron_config(), max_rows=32, per_expert_weights=False)
    from_seq.load_state_dict(seq)
    assert torch.equal(from_seq.linear_fc2.bias, grouped.linear_fc2.bias)
    # Optimizer state keyed by parameter name: per expert -> grouped -> per expert.
    opt = {f"decoder.experts.{n}": {"exp_avg": torch.randn_like(q, dtype=torch.float32), "step": torch.tensor(3.0)}
           for n, q in per.named_parameters()}
    folded = normalize_optimizer_state(copy.deepcopy(opt), "decoder.experts.", ME, per_expert=False)
    assert folded["decoder.experts.linear_fc1.weight"]["exp_avg"].shape == (ME, 2 * MF, MH)
    assert torch.equal(folded["decoder.experts.linear_fc1.weight"]["exp_avg"][1],
                       opt["decoder.experts.linear_fc1.weight1"]["exp_avg"])
    split = normalize_optimizer_state(folded, "decoder.experts.", ME, per_expert=True)
    assert split.keys() == opt.keys()
    assert torch.equal(split["decoder.experts.linear_fc2.bias3"]["exp_avg"], opt["decoder.experts.linear_fc2.bias3"]["exp_avg"])
    bad = copy.deepcopy(opt)
    bad["decoder.experts.linear_fc1.weight2"]["step"] = torch.tensor(4.0)
    with pytest.raises(ValueError, match="step"):
        normalize_optimizer_state(bad, "decoder.experts.", ME, per_expert=False)


def test_megatron_unsupported_configs_are_refused():
    from moe_engine.integrations.megatron import MegatronGroupedMLP
    with pytest.raises(NotImplementedError, match="erf GELU"):
        MegatronGroupedMLP(ME, megatron_config(activation_func=F.gelu), max_rows=8)
    with pytest.raises(NotImplementedError, match="moe_latent_size"):
        MegatronGroupedMLP(ME, megatron_config(moe_latent_size=32), max_rows=8)
    with pytest.raises(ValueError, match="max_rows"):
        MegatronGroupedMLP(ME, megatron_config())
    # Expert tensor parallelism: biases (fc2's is replicated over ranks that return partial sums), an
    # FFN width the ranks cannot share, expert GTP weight rematerialization, a group of another size.
    with pytest.raises(NotImplementedError, match="add_bias_linear"):
        MegatronGroupedMLP(ME, megatron_config(expert_tensor_parallel_size=2, add_bias_linear=True), max_rows=8)
    with pytest.raises(ValueError, match="not divisible"):
        MegatronGroupedMLP(ME, megatron_config(expert_tensor_parallel_size=3), max_rows=8)
    with pytest.raises(ValueError, match="interleave_size 24 does not divide this rank's 32 features"):
        MegatronGroupedMLP(ME, megatron_config(expert_tensor_parallel_size=2, moe_mlp_glu_interleave_size=24),
                           max_rows=8)
    with pytest.raises(NotImplementedError, match="GTP"):
        MegatronGroupedMLP(ME, megatron_config(expert_gtp_weight_remat_size=2), max_rows=8)
    with pytest.raises(ValueError, match="expt_tp has 1 ranks"):
        MegatronGroupedMLP(ME, megatron_config(expert_tensor_parallel_size=2), max_rows=8,
                           pg_collection=types.SimpleNamespace(expt_tp=types.SimpleNamespace(size=lambda: 1)))
    etp = MegatronGroupedMLP(ME, megatron_config(expert_tensor_parallel_size=2, add_bias_linear=False), max_rows=8)
    assert etp.ffn_hidden_size == megatron_config().moe_ffn_hidden_size // 2
    mod = MegatronGroupedMLP(ME, megatron_config(), max_rows=8)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        mod(torch.zeros(4, MH, device=DEV, dtype=torch.bfloat16), torch.tensor([4, 0], device=DEV),
            torch.ones(4, device=DEV))


def test_megatron_probs_on_input_topk1():
    from moe_engine.integrations.megatron import MegatronGroupedMLP
    config = megatron_config(moe_apply_probs_on_input=True, moe_router_topk=1, add_bias_linear=False)
    mod = MegatronGroupedMLP(ME, config, max_rows=32)
    randomize(mod, 8)
    counts = [3, 5, 2, 6]
    x, tpe, probs, _ = megatron_batch(counts, 9)
    out, _ = mod(x, tpe, probs)
    # Megatron: x scaled by the prob (rounded to bf16), then the experts with prob 1.
    xs = (probs.unsqueeze(-1) * x).to(x.dtype)
    w1, w2 = stacked(mod, "linear_fc1", "weight"), stacked(mod, "linear_fc2", "weight")
    zeros1, zeros2 = torch.zeros(ME, 2 * MF, device=DEV), torch.zeros(ME, MH, device=DEV)
    ref = megatron_reference(xs, counts, torch.ones_like(probs), w1, zeros1, w2, zeros2, config)
    assert rel_err(out, ref) < REF_TOL

