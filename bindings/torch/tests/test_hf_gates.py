"""Which activation the Hugging Face experts implementation runs for each experts class (no GPU: the
classes are built on the CPU and only their gate is read): the clamped gates of DeepSeek-V4, GLM-5-Next,
Hunyuan v4, MiniMax-M3 and OpenAI's privacy filter map to clamped-swiglu with the module's own limit (and
the alpha of the latter two), and a gate the library does not implement is refused by name."""
import importlib
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from moe_engine.integrations.transformers import _activation  # noqa: E402

H, FFN, E = 64, 32, 4
LIMIT = 0.3  # not any class's default, so that reading it from the module is what is tested

# family: (module, config class, experts class, config kwargs, expected (alpha, offset)); the privacy
# filter's constants are module attributes (not in its config), set on the module below.
CLAMPED = {
    "deepseek_v4": ("deepseek_v4", "DeepseekV4Config", "DeepseekV4Experts",
                    dict(n_routed_experts=E, moe_intermediate_size=FFN), (1.0, 0.0)),
    "glm5_next": ("glm5_next", "Glm5NextTextConfig", "Glm5NextTextExperts",
                  dict(n_routed_experts=E, moe_intermediate_size=FFN), (1.0, 0.0)),
    "hy_v4": ("hy_v4", "HYV4Config", "HYV4Experts", dict(n_routed_experts=E, moe_intermediate_size=FFN), (1.0, 0.0)),
    "minimax_m3_vl": ("minimax_m3_vl", "MiniMaxM3VLTextConfig", "MiniMaxM3VLExperts",
                      dict(num_local_experts=E, intermediate_size=FFN, swiglu_alpha=1.5), (1.5, 1.0)),
    "openai_privacy_filter": ("openai_privacy_filter", "OpenAIPrivacyFilterConfig", "OpenAIPrivacyFilterExperts",
                              dict(num_local_experts=E, intermediate_size=FFN), (1.5, 1.0)),
}


def experts(family):
    module, cfg_cls, cls, kwargs, _ = CLAMPED[family]
    try:
        mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        cfg = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no {module}")
    experts = getattr(mod, cls)(getattr(cfg, cfg_cls)(hidden_size=H, swiglu_limit=LIMIT, **kwargs))
    if family == "openai_privacy_filter":
        experts.alpha, experts.limit = 1.5, LIMIT
    return experts


@pytest.mark.parametrize("family", sorted(CLAMPED))
def test_clamped_gates_run_as_clamped_swiglu_with_the_modules_constants(family):
    spec = types.SimpleNamespace()
    _activation(experts(family), spec, has_gate=True)
    alpha, offset = CLAMPED[family][4]
    assert spec.activation == "clamped-swiglu"
    assert (spec.alpha, spec.offset) == (alpha, offset)
    assert spec.limit == pytest.approx(LIMIT)


@pytest.mark.parametrize("family", sorted(CLAMPED))
def test_the_mapping_computes_what_the_class_computes(family):
    # The op's clamped-swiglu, a * sigmoid(alpha a) * (clamp(up, -L, L) + offset) with a = min(gate, L),
    # written out here, against the class's own _apply_gate on the same [gate | up] halves.
    mod = experts(family)
    spec = types.SimpleNamespace()
    _activation(mod, spec, has_gate=True)
    gate_up = torch.randn(16, 2 * FFN, generator=torch.Generator().manual_seed(0)) * 2
    g, u = gate_up.chunk(2, dim=-1)
    a = g.clamp(max=spec.limit)
    ours = a * torch.sigmoid(spec.alpha * a) * (u.clamp(-spec.limit, spec.limit) + spec.offset)
    torch.testing.assert_close(ours, mod._apply_gate(gate_up), rtol=1e-6, atol=1e-6)


def test_deepseek_v4_with_another_act_fn_and_unknown_gates_are_refused():
    mod = experts("deepseek_v4")
    mod.act_fn = torch.nn.ReLU()
    with pytest.raises(NotImplementedError, match="DeepseekV4Experts.act_fn is ReLU"):
        _activation(mod, types.SimpleNamespace(), has_gate=True)

    class Custom(type(experts("hy_v4"))):
        def _apply_gate(self, gate_up):
            return gate_up
    custom = experts("hy_v4")
    custom.__class__ = Custom
    with pytest.raises(NotImplementedError, match="custom gate"):
        _activation(custom, types.SimpleNamespace(), has_gate=True)
