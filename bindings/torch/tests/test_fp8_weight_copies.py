"""The quantized weight copies from PyTorch: GroupedMLP / GroupedExperts.fp8_weights() (a snapshot of
the copies the GEMMs compute with) and load_fp8_weights() (loaded bytes written into them, which then
count as refreshed) -- docs/layer.md, FP8 experts."""
import pytest
import torch

from moe_engine import GroupedExperts, GroupedMLP
from quant_emulation import DEV, routing

T, H, F_, E, K = 256, 256, 384, 4, 2
PARTS = {"block": ("", "_scale_inv", "_columnwise", "_columnwise_scale_inv"),
         "block_pow2": ("", "_scale_inv", "_columnwise", "_columnwise_scale_inv"),
         "mxfp8": ("", "_scale_inv", "_columnwise", "_columnwise_scale_inv"),
         "nvfp4": ("", "_scale_inv", "_columnwise", "_columnwise_scale_inv", "_amax")}


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _mlp(fp8, refresh="on_request", **kw):
    return GroupedMLP(H, F_, E, K, max_tokens=T, bias=True, fp8=fp8, fp8_weight_refresh=refresh, **kw)


def _inputs(seed):
    idx, probs = routing(T, E, K, seed)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    x = (torch.randn(T, H, device=DEV, generator=g) * 0.5).bfloat16()
    dy = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    return x, idx, probs, dy


def _step(mod, x, idx, probs, dy):
    xr = x.detach().clone().requires_grad_()
    pr = probs.detach().clone().requires_grad_()
    y = mod(xr, idx, pr)
    y.backward(dy)
    mod.check_errors()
    out = {"y": y.detach(), "dx": xr.grad, "dprobs": pr.grad, **{n: q.grad for n, q in mod.named_parameters()}}
    for q in mod.parameters():
        q.grad = None
    return out


@pytest.mark.parametrize("fp8", ["block", "block_pow2", "mxfp8", "nvfp4"])
def test_loaded_copies_give_the_snapshot_layers_results_bit_for_bit(fp8):
    """Layer b (bf16 weights of its own, a's biases) loads layer a's snapshot: its forward and backward
    are bitwise a's -- the GEMMs read the loaded copies, not b's weights -- and its own snapshot is the
    loaded one; a refresh then quantizes b's weights again (other results)."""
    torch.manual_seed(31)
    a, b = _mlp(fp8), _mlp(fp8)
    with torch.no_grad():
        b.fc1.bias.copy_(a.fc1.bias)
        b.fc2.bias.copy_(a.fc2.bias)
    with pytest.raises(ValueError, match="refresh_fp8_weights"):
        a.fp8_weights()  # no copies of the bound weights yet
    a.refresh_fp8_weights()
    snap = a.fp8_weights()
    assert sorted(snap) == sorted(f"fc{i}.weight{s}" for i in (1, 2) for s in PARTS[fp8])
    data_dtype = torch.uint8 if fp8 == "nvfp4" else torch.float8_e4m3fn
    assert snap["fc1.weight"].dtype == data_dtype and snap["fc1.weight"].shape[:2] == (E, 2 * F_)
    assert snap["fc2.weight_columnwise"].shape[:2] == (E, F_)
    if fp8 == "block_pow2":  # every scale a power of two: sign and mantissa bits clear
        for n in ("fc1.weight_scale_inv", "fc2.weight_columnwise_scale_inv"):
            assert not (snap[n].view(torch.int32) & ((1 << 23) - 1)).any(), n
    b.load_fp8_weights(snap)
    assert all(_same_bits(v, snap[n]) for n, v in b.fp8_weights().items())
    x, idx, probs, dy = _inputs(32)
    want, got = _step(a, x, idx, probs, dy), _step(b, x, idx, probs, dy)
    for key, v in want.items():
        assert _same_bits(got[key], v), key
    # The snapshot is a copy: a's copies change with a refresh of new weights, the snapshot does not.
    before = {n: v.clone() for n, v in snap.items()}
    with torch.no_grad():
        a.fc1.weight.mul_(2)
    a.refresh_fp8_weights()
    assert all(_same_bits(v, before[n]) for n, v in snap.items())
    b.refresh_fp8_weights()
    assert not _same_bits(_step(b, x, idx, probs, dy)["y"], want["y"])


def test_load_from_a_checkpoint_dict_with_a_prefix_into_per_expert_experts():
    """GroupedExperts with per-expert weights and fp8_weight_refresh="from_master" load the copies of a
    single-grouped GroupedMLP from a larger dict under a prefix (the copies are single grouped in both
    layouts): the experts' output on the same expert rows equals that layer's experts' output."""
    torch.manual_seed(33)
    a = _mlp("block")
    a.refresh_fp8_weights()
    ckpt = {f"model.layers.3.mlp.{n}": v for n, v in a.fp8_weights().items()}
    ckpt["model.layers.3.mlp.fc1.bias"] = a.fc1.bias.detach()  # other keys are ignored
    ex = GroupedExperts(H, F_, E, 512, bias=True, per_expert_weights=True, fp8="block",
                        fp8_weight_refresh="from_master", accumulate_into_main_grad=True)
    ref = GroupedExperts(H, F_, E, 512, bias=True, fp8="block", fp8_weight_refresh="on_request")
    with torch.no_grad():
        for e in range(E):
            getattr(ex.fc1, f"bias{e}").copy_(a.fc1.bias[e])
            getattr(ex.fc2, f"bias{e}").copy_(a.fc2.bias[e])
        ref.fc1.bias.copy_(a.fc1.bias)
        ref.fc2.bias.copy_(a.fc2.bias)
    ex.load_fp8_weights(ckpt, prefix="model.layers.3.mlp.")
    ref.load_fp8_weights(ckpt, prefix="model.layers.3.mlp.")
    offsets = torch.tensor([0, 128, 256, 256, 512], dtype=torch.int32, device=DEV)  # expert 2 empty
    x_perm = (torch.randn(512, H, device=DEV) * 0.5).bfloat16()
    probs = torch.rand(512, device=DEV)
    with torch.no_grad():
        assert _same_bits(ex(x_perm, offsets, probs), ref(x_perm, offsets, probs))
    assert all(_same_bits(v, ckpt["model.layers.3.mlp." + n]) for n, v in ex.fp8_weights().items())


def test_block_columnwise_parts_are_derived_from_the_rowwise_ones():
    """fp8="block" with only the rowwise parts (data and scale_inv, as DeepSeek-V3's checkpoints store
    weights): the columnwise copies derived by transposition are bitwise the ones the layer's own
    quantization made."""
    torch.manual_seed(35)
    a, b = _mlp("block"), _mlp("block")
    a.refresh_fp8_weights()
    snap = a.fp8_weights()
    b.load_fp8_weights({n: v for n, v in snap.items() if "_columnwise" not in n})
    assert all(_same_bits(v, snap[n]) for n, v in b.fp8_weights().items())
    with pytest.raises(KeyError, match="fc1.weight_columnwise"):  # mxfp8's 1x32 blocks do not transpose
        _mlp("mxfp8").load_fp8_weights({n: v for n, v in snap.items() if "_columnwise" not in n})


def test_bad_loads_are_refused_by_name_before_any_byte_is_written():
    torch.manual_seed(34)
    a, b = _mlp("block"), _mlp("block")
    a.refresh_fp8_weights()
    b.refresh_fp8_weights()
    snap, b_before = a.fp8_weights(), b.fp8_weights()
    with pytest.raises(KeyError, match="fc2.weight_columnwise_scale_inv"):
        b.load_fp8_weights({n: v for n, v in snap.items() if n != "fc2.weight_columnwise_scale_inv"})
    with pytest.raises(ValueError, match="fc1.weight_scale_inv"):
        b.load_fp8_weights({**snap, "fc1.weight_scale_inv": snap["fc1.weight_scale_inv"].bfloat16()})
    with pytest.raises(ValueError, match="fc2.weight"):
        b.load_fp8_weights({**snap, "fc2.weight": snap["fc2.weight"][:, :, :128]})
    with pytest.raises(ValueError, match="'fc1.weight_columnwise'"):
        b.load_fp8_weights({**snap, "fc1.weight_columnwise": snap["fc1.weight_columnwise"].tolist()})
    assert all(_same_bits(v, b_before[n]) for n, v in b.fp8_weights().items())
    with pytest.raises(ValueError, match="every_forward"):
        _mlp("block", refresh="every_forward").load_fp8_weights(snap)
    plain = GroupedMLP(H, F_, E, K, max_tokens=T)
    with pytest.raises(ValueError, match="quantize"):
        plain.fp8_weights()
    with pytest.raises(ValueError, match="quantize"):
        plain.load_fp8_weights(snap)
