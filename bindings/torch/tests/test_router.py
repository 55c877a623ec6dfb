"""moe_engine.Router against plain PyTorch compositions (selection exact, probs and d logits within
fp32 rounding) and against the routers of the Hugging Face families (transformers 5.x; skipped when
it is not installed): Mixtral, Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V3."""
import importlib

import pytest
import torch

from moe_engine import Router, update_expert_bias

DEV = "cuda"
# Probs: fp32 on both sides (exp, sums of <= E terms, one division): 1e-5 relative covers a few
# hundred ulps; gradients: 1e-4 relative to the largest entry of the reference.
PROB_RTOL = 1e-5


def torch_route(logits, k, score="softmax", normalize=False, after=False, bias=None, groups=1, topk_groups=1,
                scale=1.0):
    """The PyTorch composition each preset replaces (fp32)."""
    z = logits.float()
    s = torch.softmax(z, -1) if score == "softmax" else torch.sigmoid(z)
    if after:
        vals, idx = torch.topk(z, k, -1)
        return idx, torch.softmax(vals, -1) * scale
    choice = (s + bias) if bias is not None else s
    if groups > 1:
        T, E = z.shape
        g = choice.view(T, groups, E // groups).topk(2, -1)[0].sum(-1)
        keep = torch.zeros_like(g).scatter_(1, torch.topk(g, topk_groups, -1)[1], 1.0)
        mask = keep.unsqueeze(-1).expand(T, groups, E // groups).reshape(T, E).bool()
        choice = choice.masked_fill(~mask, float("-inf"))
    idx = torch.topk(choice, k, -1)[1]
    p = s.gather(1, idx)
    if normalize:
        p = p / p.sum(-1, keepdim=True)
    return idx, p * scale


def exact_ties(logits, k, ref_kwargs):
    """Rows whose k + 1 best selection scores (what top-k compares) hold an exact tie."""
    z = logits.float()
    after = ref_kwargs.get("after", False)
    score = ref_kwargs.get("score", "softmax")
    s = z if after else (torch.softmax(z, -1) if score == "softmax" else torch.sigmoid(z))
    top = torch.topk(s, min(k + 1, s.shape[1]), -1)[0]
    return (top[:, 1:] == top[:, :-1]).any(-1), s, top[:, k - 1]


def check_against(router, logits, ref_kwargs, k):
    x = logits.detach().clone().requires_grad_()
    out = router(x)
    xr = logits.detach().float().clone().requires_grad_()
    idx, p = torch_route(xr, k, **ref_kwargs)
    # torch.topk orders exact ties arbitrarily, ours toward the lower expert id: rows with a tie among
    # their k + 1 best selection scores (bf16 logits tie often) are left out of the comparison; on
    # them ours must still pick scores no lower than the reference's k-th best.
    tied, score, kth = exact_ties(xr.detach(), k, ref_kwargs)
    assert tied.float().mean() < 0.5, "too many tied rows for a meaningful comparison"
    ours_idx = out.indices.long()
    assert bool((score.gather(1, ours_idx)[tied] >= kth[tied].unsqueeze(1)).all()), "a tied row picked a lower score"
    assert torch.equal(ours_idx[~tied], idx[~tied]), "selection differs"
    assert torch.allclose(out.probs[~tied], p[~tied], rtol=PROB_RTOL, atol=1e-7)
    dp = torch.randn_like(p)
    (out.probs * dp).sum().backward()
    (p * dp).sum().backward()
    g, gr = x.grad.float()[~tied], xr.grad[~tied]
    # fp32 logits: fp32 arithmetic; bf16 logits: d logits is rounded to bf16 once (2^-8 relative).
    rel = 2.0 ** -8 if x.dtype == torch.bfloat16 else 0.0
    assert bool(((g - gr).abs() <= rel * gr.abs() + 1e-4 * gr.abs().max() + 1e-7).all())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_presets_match_the_pytorch_composition(dtype):
    torch.manual_seed(0)
    T = 1000
    cases = [
        (Router.mixtral(8, 2, T), dict(normalize=True), 8, 2),
        (Router.qwen3(128, 8, T), dict(normalize=True), 128, 8),
        (Router.olmoe(64, 8, T), dict(), 64, 8),
        (Router.gpt_oss(32, 4, T), dict(after=True), 32, 4),
    ]
    for router, kw, E, k in cases:
        logits = torch.randn(T, E, device=DEV).to(dtype)
        out = check_against(router, logits, kw, k)
        assert out.indices.dtype == torch.int32 and out.probs.dtype == torch.float32
        assert torch.equal(out.counts, torch.bincount(out.indices.long().flatten(), minlength=E))


def test_deepseek_v3_with_bias_and_groups():
    torch.manual_seed(1)
    T, E, k = 1000, 256, 8
    router = Router.deepseek_v3(E, k, T).to(DEV)
    router.expert_bias.uniform_(-0.01, 0.01)
    logits = torch.randn(T, E, device=DEV)
    check_against(router, logits, dict(score="sigmoid", normalize=True, bias=router.expert_bias, groups=8,
                                       topk_groups=4, scale=2.5), k)


def test_losses_and_their_gradients():
    torch.manual_seed(2)
    T, E, k = 512, 16, 2
    router = Router(E, k, T, normalize_topk=True, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                    seq_aux_loss_coeff=0.1, seq_length=128)
    logits = torch.randn(T, E, device=DEV)
    x = logits.clone().requires_grad_()
    out = router(x)
    (out.aux_loss + out.z_loss + out.seq_aux_loss).backward()
    xr = logits.clone().requires_grad_()
    s = torch.softmax(xr, -1)
    idx = torch.topk(s, k, -1)[1]
    f = torch.bincount(idx.flatten(), minlength=E).float() / (T * k)
    aux = 0.01 * E * (f * s.mean(0)).sum()
    z = 0.001 * (torch.logsumexp(xr, -1) ** 2).mean()
    seq = 0
    for b in range(T // 128):
        sl = slice(b * 128, (b + 1) * 128)
        fb = torch.bincount(idx[sl].flatten(), minlength=E).float() * E / (k * 128)
        seq = seq + (fb * s[sl].mean(0)).sum()
    seq = 0.1 * seq / (T // 128)
    for got, want in ((out.aux_loss, aux), (out.z_loss, z), (out.seq_aux_loss, seq)):
        assert torch.allclose(got, want, rtol=1e-5)
    (aux + z + seq).backward()
    assert (x.grad - xr.grad).abs().max() <= 1e-4 * xr.grad.abs().max()


def test_capacity_rounding_map_form_and_bias_update():
    torch.manual_seed(3)
    T, E, k = 2048, 32, 4
    logits = torch.randn(T, E, device=DEV)
    cap = Router(E, k, T, capacity_factor=1.0)
    out = cap(logits)
    limit = -(-T * k // E)
    assert int(out.counts.max()) <= limit and int((out.indices >= 0).sum()) == int(out.counts.sum())
    rnd = Router(E, k, T, rounding="nearest", rounding_tile=64, output_form="map")
    out = rnd(logits)
    assert out.map.dtype == torch.bool and torch.equal(out.map.sum(0), out.counts)
    assert torch.equal(out.probs > 0, out.map)
    down = Router(E, k, T, rounding="down", rounding_tile=64)(logits)
    assert bool((down.counts % 64 == 0).all())
    counts = torch.tensor([3, 1, 2, 2], device=DEV)
    bias = torch.zeros(4, device=DEV)
    update_expert_bias(counts, bias, 0.5)
    assert bias.tolist() == [-0.5, 0.5, 0.0, 0.0]


def test_graph_replay_and_nonfinite_logits():
    torch.manual_seed(4)
    T, E, k = 1024, 64, 8
    router = Router.qwen3(E, k, T)
    static = torch.randn(T, E, device=DEV)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        router(static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = router(static)
    for i in range(3):
        static.copy_(torch.randn(T, E, device=DEV))
        g.replay()
        eager = router(static.clone())
        assert torch.equal(out.indices, eager.indices) and torch.equal(out.probs, eager.probs)
    bad = torch.randn(T, E, device=DEV)
    bad[3, 5] = float("nan")
    o = router(bad)
    assert bool((o.indices[3] == -1).all())
    with pytest.raises(ValueError, match="non-finite"):
        router.check_errors()


# ---- Hugging Face families ----

def _hf_block(family, cfg_kwargs):
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("needs transformers 5.x")
    mod = importlib.import_module(f"transformers.models.{family[0]}.modeling_{family[0]}")
    cfg_mod = importlib.import_module(f"transformers.models.{family[0]}.configuration_{family[0]}")
    config = getattr(cfg_mod, family[1])(**cfg_kwargs)
    return getattr(mod, family[2])(config).to(DEV).float().eval(), config


def _hf_route(block, gate, x, family):
    """(indices [T, k] long, weights [T, k] fp32) as the family's module routes x."""
    if family == "deepseek_v3" and hasattr(block, "route_tokens_to_experts"):
        logits = gate(x)
        idx, w = block.route_tokens_to_experts(logits)
        return idx, w.float()
    out = gate(x)
    out = out if isinstance(out, tuple) else (out,)
    idx = next(o for o in out if not o.is_floating_point())
    floats = [o for o in out if o.is_floating_point()]
    w = next((o for o in floats if o.shape == idx.shape), None)
    if w is None:  # scores scattered into [T, E]
        w = floats[-1].gather(1, idx)
    return idx.long(), w.float()


HF_CASES = [
    # (module, config class, block class), config kwargs, our router, logits from the gate
    (("mixtral", "MixtralConfig", "MixtralSparseMoeBlock"), dict(num_local_experts=8, num_experts_per_tok=2),
     lambda T: Router.mixtral(8, 2, T)),
    (("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock"),
     dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, moe_intermediate_size=64),
     lambda T: Router.qwen3(16, 4, T)),
    (("olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock"), dict(num_experts=16, num_experts_per_tok=4),
     lambda T: Router.olmoe(16, 4, T)),
    (("gpt_oss", "GptOssConfig", "GptOssMLP"), dict(num_local_experts=8, num_experts_per_tok=2),
     lambda T: Router.gpt_oss(8, 2, T)),
    (("deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE"),
     dict(n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
          norm_topk_prob=True, n_shared_experts=1, moe_intermediate_size=64),
     lambda T: Router.deepseek_v3(32, 4, T, n_group=4, topk_group=2, routed_scaling_factor=2.5)),
]


@pytest.mark.parametrize("case", HF_CASES, ids=[c[0][0] for c in HF_CASES])
def test_matches_hugging_face_router(case):
    family, cfg_kwargs, make_router = case
    torch.manual_seed(5)
    block, config = _hf_block(family, dict(hidden_size=64, intermediate_size=128, **cfg_kwargs))
    gate = getattr(block, "gate", None) or getattr(block, "router")
    with torch.no_grad():
        for p in gate.parameters():
            p.normal_(0, 0.2)
    T = 777
    x = torch.randn(T, 64, device=DEV)
    router = make_router(T).to(DEV)
    with torch.no_grad():
        if family[0] == "deepseek_v3":
            gate.e_score_correction_bias.uniform_(-0.01, 0.01)
            router.expert_bias.copy_(gate.e_score_correction_bias.float())
        logits = torch.nn.functional.linear(x, gate.weight, getattr(gate, "bias", None))
        hf_idx, hf_w = _hf_route(block, gate, x, family[0])
        out = router(logits)
    # Selection: the same set of experts per token (DeepSeek-V3's topk is unsorted); probs in the
    # same expert order, fp32 both sides.
    ours, order = out.indices.long().sort(-1)
    theirs, horder = hf_idx.sort(-1)
    assert torch.equal(ours, theirs), f"{family[0]}: selection differs"
    assert torch.allclose(out.probs.gather(1, order), hf_w.gather(1, horder), rtol=PROB_RTOL, atol=1e-6)
