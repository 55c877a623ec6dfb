"""MegatronGroupedMLP inside megatron-core's own MoE layer (megatron-core 0.19, world size 1).

Needs megatron-core importable (scripts/stage_megatron.sh stages the wheels; docs/integrations.md
says how to install them) and a CUDA GPU. Skipped when no `megatron` package is found at all; when
one is found but fails to import (a missing dependency), the error is reported, not skipped.

The process joins a one-rank NCCL process group and Megatron's parallel state (module fixture). The
reference is the MoE layer Megatron's local GPT spec builds (`get_moe_module_spec(use_te=False)`:
MoELayer with SequentialMLP experts of ColumnParallelLinear / RowParallelLinear, TopKRouter, the
allgather or alltoall token dispatcher); ours is the same spec with `MoESubmodules.experts` replaced
by `functools.partial(MegatronGroupedMLP, max_rows=...)`. Weights go from the reference to ours
through `load_state_dict` (SequentialMLP's keys `experts.local_experts.{i}.linear_fc1.weight` are
converted on load), so both layers hold the same router and experts.

Checked: the expert inputs Megatron's dispatcher hands to both experts modules are identical
(routing, permutation, probs); the layer output, the input gradient, the router's and every expert
parameter's gradient agree; with gradient_accumulation_fusion the gradients land in fp32 `main_grad`
(attached by hand, with the per-parameter hooks Megatron's DDP puts on the gradient accumulators);
with delay_wgrad_compute, MoELayer.backward_dw() fires each parameter's DDP hook (registered the way
Megatron's DDP registers them) exactly once, fc2's before fc1's, with main_grad final at that point;
checkpoints go SequentialMLP -> per-expert -> grouped -> per-expert -> SequentialMLP bitwise; in
Megatron's distributed checkpoint format, what the experts' sharded state dict puts in a checkpoint
equals SequentialMLP's (also placed as an expert-parallel or expert-data-parallel rank of a larger
group, under a pipeline offset, with singleton local shards), torch_dist files go SequentialMLP ->
ours -> SequentialMLP bitwise, and optimizer states move between our two parameter layouts.

Tolerance (relative L2 error, TOL = 4e-2): both sides compute in bf16 with fp32 accumulation but
round at different places -- Megatron after fc1, the bias add, the activation, the gating product,
the prob scale, fc2 and the bias add; moe_engine in its fused epilogues. The project's tests bound
each side's distance to an fp32 reference by 2e-2 (a few bf16 roundings of relative size <= 2^-8);
two such budgets add to 4e-2. A wrong expert, prob, bias or gate/linear layout gives errors of
order 1. Every failure message prints the measured error.

Biases: megatron-core 0.19's local expert MLP cannot run add_bias_linear under autograd (MLP.forward
adds the prob-scaled fc2 bias in place into the output of RowParallelLinear's custom autograd
Function, which PyTorch refuses: "Output 0 of _ReduceFromModelParallelRegionBackward is a view and
is being modified inplace"), so the reference comparisons run without biases; the checkpoint round
trip keeps them (and compares the forwards under no_grad). Our biased path is checked against a
plain-PyTorch reference in test_integrations.py."""
import copy
import dataclasses
import functools
import importlib.util
import re
import socket
import types

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (scripts/stage_megatron.sh; docs/integrations.md)",
                allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import megatron.core  # noqa: E402  (an ImportError here names the missing dependency)
from megatron.core import parallel_state  # noqa: E402
from megatron.core.activations import squared_relu  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from moe_engine.integrations.megatron import MegatronGroupedMLP, grouped_to_sequential_keys  # noqa: E402
from reference import rel_err  # noqa: E402

H, FFN, E, K = 128, 64, 8, 2
S, B = 32, 2  # sequence x micro-batch: [S, B, H] is the layer's input
MAX_ROWS = S * B * K  # dropless, world size 1
TOL = 4e-2
PER_EXPERT_NAME = re.compile(r"experts\.(linear_fc[12])\.(weight|bias)(\d+)")
EXPERT_KEYS = [(o, w) for o in ("linear_fc1", "linear_fc2") for w in ("weight", "bias")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    assert megatron.core.__version__.startswith("0.19"), \
        f"written against megatron-core 0.19 (its MoE builder protocol), found {megatron.core.__version__}"
    torch.cuda.set_device(0)
    created = not torch.distributed.is_initialized()
    if created:
        torch.distributed.init_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{free_port()}",
                                             rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        torch.distributed.destroy_process_group()


def make_config(dispatcher="allgather", bias=False, **over):
    kw = dict(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN, num_moe_experts=E,
              moe_ffn_hidden_size=FFN, moe_router_topk=K, moe_token_dispatcher_type=dispatcher,
              moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=bias, bias_activation_fusion=False,
              bf16=True, params_dtype=torch.bfloat16, transformer_impl="local", moe_grouped_gemm=False)
    kw.update(over)
    return TransformerConfig(**kw)


def build_layer(config, experts=None):
    """Megatron's local-spec MoE layer, built the way TransformerLayer builds its mlp; `experts`
    replaces MoESubmodules.experts (SequentialMLP) when given."""
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    submodules = spec.keywords["submodules"]
    if experts is not None:
        spec = functools.partial(spec.func, *spec.args,
                                 **{**spec.keywords, "submodules": dataclasses.replace(submodules, experts=experts)})
    layer = spec(config=config, pg_collection=get_default_pg_collection(), is_mtp_layer=False,
                 name="decoder.layers.0.mlp")
    layer.set_layer_number(1)
    return layer.cuda()


def ours(per_expert_weights=True):
    return functools.partial(MegatronGroupedMLP, max_rows=MAX_ROWS, per_expert_weights=per_expert_weights)


def randomized_reference(config, seed=0):
    ref = build_layer(config)
    assert isinstance(ref.experts, SequentialMLP), type(ref.experts)
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, q in ref.named_parameters():
            std = 0.5 if name.endswith("bias") else q.shape[-1] ** -0.5  # non-zero biases: adding them is tested
            q.copy_(torch.randn(q.shape, device="cuda", generator=g) * std)
    return ref


def our_layer(config, ref, per_expert_weights=True):
    layer = build_layer(config, ours(per_expert_weights))
    assert isinstance(layer.experts, MegatronGroupedMLP), type(layer.experts)
    layer.load_state_dict(ref.state_dict(), strict=True)  # SequentialMLP's keys are converted on load
    return layer


def inputs(seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(S, B, H, device="cuda", generator=g) * 0.5).bfloat16()
    dy = torch.randn(S, B, H, device="cuda", generator=g).bfloat16()
    return x, dy


def run(layer, x, dy, backward=True):
    """Output, input gradient and the (dispatched rows, tokens_per_expert, probs) the experts got."""
    seen = {}

    def capture(module, args):
        seen["expert_inputs"] = [a.detach().clone() for a in args[:3]]
    handle = layer.experts.register_forward_pre_hook(capture)
    xr = x.clone().requires_grad_()
    try:
        out, mlp_bias = layer(xr)
    finally:
        handle.remove()
    assert mlp_bias is None, "MoELayer returned an mlp_bias"
    if backward:
        out.backward(dy)
    return out.detach(), xr.grad, seen["expert_inputs"]


def expert_tensors(layer, what="grad"):
    """{(linear_fcN, weight|bias): [E, ...]} of the experts' parameters (what: data, grad, main_grad);
    the biases only with add_bias_linear."""
    ex, out = layer.experts, {}
    for owner, w in EXPERT_KEYS:
        if w == "bias" and not layer.config.add_bias_linear:
            continue
        if isinstance(ex, SequentialMLP):
            ps = [getattr(getattr(m, owner), w) for m in ex.local_experts]
        elif ex.per_expert_weights:
            ps = [getattr(getattr(ex, owner), f"{w}{i}") for i in range(E)]
        else:
            ps = [getattr(getattr(ex, owner), w)]
        vals = [q if what == "data" else getattr(q, what) for q in ps]
        assert all(v is not None for v in vals), f"{owner}.{w}: {what} missing"
        out[(owner, w)] = torch.stack(vals) if len(vals) > 1 else vals[0]
    return out


def check_close(name, got, want, tol=TOL):
    err = rel_err(got, want)
    assert err < tol, f"{name}: relative L2 error {err:.3e} against Megatron's SequentialMLP layer (bound {tol})"


def check_same_expert_inputs(ours_in, ref_in):
    for label, a, b in zip(("dispatched rows", "tokens_per_expert", "permuted probs"), ours_in, ref_in):
        assert a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), \
            f"Megatron's dispatcher handed different {label} to the two experts modules (shapes {a.shape}, {b.shape})"


# =============================================================================================


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("bias", [False])  # see the module docstring: Megatron's reference fails with biases
def test_moe_layer_matches_sequential_mlp(dispatcher, bias):
    config = make_config(dispatcher, bias)
    ref = randomized_reference(config, seed=2)
    mine = our_layer(config, ref)
    # The flag that sends expert gradients to DDP's dense or expert-data-parallel buckets.
    flags, ref_flags = {q.allreduce for q in mine.experts.parameters()}, {q.allreduce for q in ref.experts.parameters()}
    assert flags == ref_flags and len(ref_flags) == 1, f"allreduce flags {flags}, Megatron's expert linears {ref_flags}"
    x, dy = inputs(3)
    y_ref, dx_ref, in_ref = run(ref, x, dy)
    y, dx, in_mine = run(mine, x, dy)
    check_same_expert_inputs(in_mine, in_ref)
    assert int(in_ref[1].sum()) == S * B * K, "dropless top-k: every token reaches k experts"
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    check_close("output", y, y_ref)
    check_close("input gradient", dx, dx_ref)
    for n, q in ref.router.named_parameters():
        check_close(f"router.{n} gradient", dict(mine.router.named_parameters())[n].grad, q.grad)
    got, want = expert_tensors(mine), expert_tensors(ref)
    assert got.keys() == want.keys() and len(want) == (4 if bias else 2), sorted(want)
    for key in want:
        assert got[key].dtype == torch.bfloat16, f"{key}: gradient dtype {got[key].dtype}"
        check_close(f"experts {key[0]}.{key[1]} gradient", got[key], want[key])


def test_moe_layer_without_bias_has_no_expert_biases():
    layer = build_layer(make_config(bias=False), ours())
    names = [n for n, _ in layer.experts.named_parameters()]
    assert names and not any("bias" in n for n in names), names


def attach_main_grads(layer, seed):
    """What Megatron's DDP gives each parameter (here by hand): an fp32 main_grad (random, so that
    accumulation is told from assignment) and grad_added_to_main_grad = False."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    start = {}
    for n, q in layer.named_parameters():
        q.main_grad = torch.randn(q.shape, device="cuda", generator=g)
        q.grad_added_to_main_grad = False
        start[n] = q.main_grad.clone()
    return start


def ddp_hook(name, q, fired):
    """Megatron DDP's backward post hook (distributed_data_parallel.py, _make_backward_post_hook)
    with overlap_grad_reduce=True: param.grad must be set, is added to main_grad unless the layer
    already did (grad_added_to_main_grad), then dropped; the parameter is ready once per step."""
    def hook(*unused):
        assert q.grad is not None, f"{name}: param.grad is None when DDP's hook runs (overlap_grad_reduce asserts)"
        if not q.grad_added_to_main_grad or getattr(q, "zero_out_wgrad", False):
            q.main_grad.add_(q.grad.data)
        q.grad = None
        fired.append((name, q.main_grad.clone()))
    return hook


def test_gradient_accumulation_fusion_main_grad():
    ref = randomized_reference(make_config(), seed=4)
    x, dy = inputs(5)
    run(ref, x, dy)
    want = {n: q.grad for n, q in ref.named_parameters()}
    mine = our_layer(make_config(gradient_accumulation_fusion=True), ref)
    start = attach_main_grads(mine, seed=6)
    fired, keep = [], []
    for n, q in mine.named_parameters():  # DDP: a hook on every parameter's gradient accumulator
        acc = q.expand_as(q).grad_fn.next_functions[0][0]
        acc.register_hook(ddp_hook(n, q, fired))
        keep.append(acc)
    run(mine, x, dy)
    names = [n for n, _ in fired]
    assert sorted(names) == sorted(start), f"DDP hooks fired for {sorted(names)}, expected each of {sorted(start)} once"
    for n, q in mine.named_parameters():
        assert q.grad is None, f"{n}: param.grad left after DDP's hook"
        m = PER_EXPERT_NAME.fullmatch(n)
        if m:
            assert q.grad_added_to_main_grad, f"{n}: grad_added_to_main_grad not set by the layer"
        ref_name = f"experts.local_experts.{m[3]}.{m[1]}.{m[2]}" if m else n
        check_close(f"{n} main_grad - start", q.main_grad - start[n], want[ref_name])


def test_delayed_wgrad_hooks_fire_once_fc2_before_fc1():
    ref = randomized_reference(make_config(), seed=7)
    x, dy = inputs(8)
    _, dx_ref, _ = run(ref, x, dy)
    want = expert_tensors(ref)
    config = make_config(gradient_accumulation_fusion=True)
    # Megatron validates delay_wgrad_compute only together with overlap_moe_expert_parallel_comm,
    # which needs expert parallelism (> 1 rank); at world size 1 the flag is set after validation.
    # What it changes here is the experts' own behaviour, driven through MoELayer.backward_dw().
    config.delay_wgrad_compute = True
    mine = our_layer(config, ref)
    experts = mine.experts
    assert all(q.skip_backward_post_hook for q in experts.parameters())
    for q in experts.parameters():
        q.main_grad = torch.zeros(q.shape, device="cuda")
        q.grad_added_to_main_grad = False
    # Megatron DDP's registration (DistributedDataParallel.__init__, delay_wgrad_compute): for each
    # parameter with skip_backward_post_hook, a hook on every module that has
    # register_wgrad_accumulation_and_reduce_hooks and holds the parameter.
    fired, registered = [], {}
    for n, q in mine.named_parameters():
        if not getattr(q, "skip_backward_post_hook", False):
            continue
        for module in mine.modules():
            if hasattr(module, "register_wgrad_accumulation_and_reduce_hooks"):
                for p in module.parameters():
                    if p is q:
                        module.register_wgrad_accumulation_and_reduce_hooks(ddp_hook(n, q, fired))
                        registered[n] = registered.get(n, 0) + 1
                        break
    expert_names = [f"experts.{n}" for n, _ in experts.named_parameters()]
    assert registered == {n: 1 for n in expert_names}, f"DDP would register hooks {registered}"
    _, dx, _ = run(mine, x, dy)
    check_close("input gradient (delayed wgrad)", dx, dx_ref)
    assert fired == [], f"hooks fired in backward: {[n for n, _ in fired]}"
    assert all(torch.count_nonzero(q.main_grad) == 0 for q in experts.parameters()), "wgrad computed in backward"
    mine.backward_dw()  # MoELayer.backward_dw(routed_experts=True) -> experts.backward_dw()
    names = [n for n, _ in fired]
    kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
    order = [f"experts.{o}.{w}{i}" for o in ("linear_fc2", "linear_fc1") for w in kinds for i in range(E)]
    assert names == order, f"DDP hooks fired {names}; expected each expert parameter once, fc2's then fc1's: {order}"
    # main_grad was final when each hook ran.
    at_hook = dict(fired)
    for (owner, w), g in want.items():
        got = torch.stack([at_hook[f"experts.{owner}.{w}{i}"] for i in range(E)])
        check_close(f"experts {owner}.{w} main_grad at its hook", got, g)
    assert all(q.grad is None for q in experts.parameters()), "placeholder gradients left after DDP's hooks"
    with pytest.raises(RuntimeError, match="no pending"):
        mine.backward_dw()


def test_checkpoints_sequential_per_expert_grouped_round_trip():
    config = make_config(bias=True)
    ref = randomized_reference(config, seed=9)
    ref_sd = {k: v for k, v in ref.state_dict().items()}
    assert any(k.endswith("linear_fc1._extra_state") for k in ref_sd), \
        "Megatron's local linears no longer write _extra_state (the load path drops it; nothing to test)"
    per = our_layer(config, ref, per_expert_weights=True)  # SequentialMLP -> per expert (TE's names)
    want = expert_tensors(ref, "data")
    for key, t in expert_tensors(per, "data").items():
        assert torch.equal(t, want[key]), f"SequentialMLP -> per-expert load changed {key}"
    per_sd = per.state_dict()
    assert "experts.linear_fc1.weight0" in per_sd and f"experts.linear_fc2.bias{E - 1}" in per_sd, sorted(per_sd)
    grouped = build_layer(config, ours(per_expert_weights=False))
    grouped.load_state_dict(per_sd, strict=True)  # per expert -> grouped
    for key, t in expert_tensors(grouped, "data").items():
        assert t.shape[0] == E and torch.equal(t, want[key]), f"per-expert -> grouped load changed {key}"
    back = build_layer(config, ours(per_expert_weights=True))
    back.load_state_dict(grouped.state_dict(), strict=True)  # grouped -> per expert
    back_sd = back.state_dict()
    assert back_sd.keys() == per_sd.keys(), sorted(set(back_sd) ^ set(per_sd))
    for k in per_sd:
        assert torch.equal(back_sd[k], per_sd[k]), f"per-expert -> grouped -> per-expert changed {k}"
    # grouped -> SequentialMLP's spelling -> Megatron's own layer, strict.
    seq = grouped_to_sequential_keys(dict(grouped.state_dict()), "experts.", E)
    fresh = randomized_reference(config, seed=10)
    fresh.load_state_dict(seq, strict=True)
    fresh_sd = fresh.state_dict()
    assert fresh_sd.keys() == ref_sd.keys(), sorted(set(fresh_sd) ^ set(ref_sd))
    for k, v in ref_sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(fresh_sd[k], v), f"SequentialMLP -> ours -> SequentialMLP changed {k}"
    # And the layers compute the same: the reloaded reference and the grouped layer on one input.
    x, dy = inputs(11)
    with torch.no_grad():  # Megatron's biased local MLP runs only without autograd (module docstring)
        y_ref, _, _ = run(fresh, x, dy, backward=False)
        y, _, _ = run(grouped, x, dy, backward=False)
    check_close("grouped layer output after the round trip", y, y_ref)


# -- Megatron's distributed checkpoint (dist_checkpointing, torch_dist format) -----------------


class _FakeGroup:
    """A process group as sharded_state_dict reads it (rank(), size()): places this rank's experts
    where rank `rank` of a group of `size` would hold them, without more processes."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _checkpoint_leaves(layer, prefix="decoder.layers.0.mlp.", keep=None, **kwargs):
    """What the experts' entries of the layer's sharded state dict put in a checkpoint, whatever the
    entries' layout: every ShardedTensor (factories built: the GLU halves, a grouped parameter's
    experts) and ShardedObject whose state-dict key starts with `keep` (default `{prefix}experts.`:
    a MoE layer's experts; an experts module's own entries all start with its prefix), by key and
    global offset, with its global shape, fragmentation, replica id and data."""
    keep = f"{prefix}experts." if keep is None else keep
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    leaves = {}

    def visit(x):
        if isinstance(x, ShardedTensorFactory):
            visit(x.build())
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, ShardedTensor):
            leaves[(x.key, tuple(x.global_offset))] = (
                "tensor", tuple(x.global_shape), tuple(x.axis_fragmentations), x.replica_id, x.prepend_axis_num,
                x.data.cpu().float().flatten().tolist())
        else:
            assert isinstance(x, ShardedObject), type(x)
            leaves[(x.key, tuple(x.global_offset))] = ("object", x.data, tuple(x.global_shape), x.replica_id)

    for k, v in layer.sharded_state_dict(prefix=prefix, **kwargs).items():
        if k.startswith(keep):
            visit(v)
    return leaves


@pytest.mark.parametrize("per_expert_weights", [True, False])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("placement", ["world size 1", "EP rank 3 of 4", "expert-DP rank 2 of 4",
                                       "pipeline stage 1 of 3", "singleton local shards"])
def test_distributed_checkpoint_entries_match_sequential_mlp(per_expert_weights, gated, placement):
    config = make_config(bias=True, gated_linear_unit=gated, activation_func=F.silu if gated else squared_relu)
    ref = randomized_reference(config, seed=21)
    layer = our_layer(config, ref, per_expert_weights)
    pg = get_default_pg_collection()
    groups = {"ep": pg.ep, "expt_tp": pg.expt_tp, "expt_dp": pg.expt_dp}
    kwargs = {}
    if placement == "EP rank 3 of 4":  # global experts 3E .. 4E-1 of 4E
        groups["ep"] = ref.experts.ep_group = _FakeGroup(3, 4)
    elif placement == "expert-DP rank 2 of 4":  # a replica: replica id 2
        groups["expt_dp"] = ref.experts.dp_group = _FakeGroup(2, 4)
    elif placement == "pipeline stage 1 of 3":  # an offset the model prepends
        kwargs["sharded_offsets"] = ((0, 1, 3),)
    elif placement == "singleton local shards":  # a key per expert
        kwargs["metadata"] = {"singleton_local_shards": True}
    layer.experts.pg_collection = types.SimpleNamespace(**groups)
    want, got = _checkpoint_leaves(ref, **kwargs), _checkpoint_leaves(layer, **kwargs)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for k in want:
        assert got[k] == want[k], f"{k}: ours differs from SequentialMLP's entry"


def permuted_rows(seed):
    """Rows as Megatron's dispatcher hands them to an experts module: tokens_per_expert (CPU, one
    expert empty), the permuted rows, their probs and an output gradient."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    counts = torch.tensor([9, 0, 17, 3, 30, 1, 12, 24])
    rows = int(counts.sum())
    x = (torch.randn(rows, H, device="cuda", generator=g) * 0.5).bfloat16()
    probs = torch.rand(rows, device="cuda", generator=g)
    dy = torch.randn(rows, H, device="cuda", generator=g).bfloat16()
    return counts, x, probs, dy


@pytest.mark.parametrize("per_expert_weights", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_expert_tensor_parallel_shard_matches_sequential_mlp(per_expert_weights, gated):
    """Expert tensor parallelism, as rank 1 of 2 at world size 1. Ours: a config with ETP 2 and a
    pg_collection whose expt_tp is a stand-in of 2 ranks, so each expert holds F / 2 features. The
    reference: SequentialMLP built with moe_ffn_hidden_size F / 2 -- exactly one shard's local linears
    -- loaded into ours. The same parameter shapes and TE's tensor-parallel attributes, the same
    partial output and gradients on the same rows, and, with the reference's linears then placed as
    ETP rank 1 of 2, the same checkpoint entries (each split axis 2 shards long, at rank 1's offset)."""
    act = F.silu if gated else squared_relu
    shard_config = make_config(gated_linear_unit=gated, activation_func=act, moe_ffn_hidden_size=FFN // 2)
    ref = randomized_reference(shard_config, seed=31).experts
    etp_config = copy.copy(shard_config)  # TransformerConfig's checks ran on the shard's config
    etp_config.moe_ffn_hidden_size, etp_config.expert_tensor_parallel_size = FFN, 2
    pg = get_default_pg_collection()
    tp = _FakeGroup(1, 2)
    groups = types.SimpleNamespace(ep=pg.ep, expt_tp=tp, expt_dp=pg.expt_dp)
    mine = MegatronGroupedMLP(E, etp_config, pg_collection=groups, max_rows=MAX_ROWS, per_expert_weights=per_expert_weights)
    fc1_out = (2 if gated else 1) * (FFN // 2)
    lead = () if per_expert_weights else (E,)
    for owner, shape, dim in (("linear_fc1", (fc1_out, H), 0), ("linear_fc2", (H, FFN // 2), 1)):
        for name, q in getattr(mine, owner).named_parameters():
            assert tuple(q.shape) == (*lead, *shape), (owner, name, tuple(q.shape))
            assert q.tensor_model_parallel and q.partition_dim == dim + len(lead) and q.partition_stride == 1, \
                (owner, name)
    mine.load_state_dict(ref.state_dict(), strict=True)
    counts, x, probs, dy = permuted_rows(seed=32)
    results = []
    for experts in (ref, mine):
        xr = x.clone().requires_grad_()
        y, _ = experts(xr, counts, probs)
        y.backward(dy)
        results.append((y.detach(), xr.grad))
    check_close("ETP partial output", results[1][0], results[0][0])
    check_close("ETP input gradient", results[1][1], results[0][1])
    for owner, what in (("linear_fc1", "weight"), ("linear_fc2", "weight")):
        want = torch.stack([getattr(getattr(m, owner), what).grad for m in ref.local_experts])
        got = mine.expert_params("fc1" if owner == "linear_fc1" else "fc2", what)
        got = torch.stack([q.grad for q in got]) if len(got) > 1 else got[0].grad
        check_close(f"ETP {owner}.{what} gradient", got, want)
    for m in ref.local_experts:  # the reference's expert linears as ETP rank 1 of 2, for their entries
        m.tp_group = m.linear_fc1.tp_group = m.linear_fc2.tp_group = tp
    prefix = "decoder.layers.0.mlp.experts."
    want, got = _checkpoint_leaves(ref, prefix, keep=prefix), _checkpoint_leaves(mine, prefix, keep=prefix)
    assert want and got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for k in want:
        assert got[k] == want[k], f"{k}: ours differs from SequentialMLP's entry"
    fc2 = [v for (key, _), v in want.items() if key.endswith("linear_fc2.weight")]
    assert fc2 and all(v[1][-1] == FFN for v in fc2), "fc2's columns: two shards of F / 2"


@pytest.mark.parametrize("gated", [True, False])
def test_expert_tensor_parallel_shards_add_up_to_the_whole_expert(gated):
    """ETP 2 as two modules, ranks 0 and 1 (stand-in groups), each given its shard of a full-width
    SequentialMLP cut the way Megatron cuts its expert linears (fc1: rank r's rows of the gate and of
    the linear half; fc2: rank r's columns): their partial outputs add up to the whole experts'
    output, and each shard's weight gradients are the matching slices of the whole ones."""
    act = F.silu if gated else squared_relu
    config = make_config(gated_linear_unit=gated, activation_func=act)
    ref = randomized_reference(config, seed=33).experts
    etp_config = copy.copy(config)
    etp_config.expert_tensor_parallel_size = 2
    pg = get_default_pg_collection()
    half = FFN // 2

    def fc1_rows(r):  # rank r's rows of a [2F, H] (gated: gate half then linear half) or [F, H] weight
        parts = (0, FFN) if gated else (0,)
        return torch.cat([torch.arange(p + r * half, p + (r + 1) * half) for p in parts]).cuda()

    counts, x, probs, dy = permuted_rows(seed=34)
    xr = x.clone().requires_grad_()
    y_ref, _ = ref(xr, counts, probs)
    y_ref.backward(dy)
    y_sum, dx_sum = 0, 0
    for r in (0, 1):
        groups = types.SimpleNamespace(ep=pg.ep, expt_tp=_FakeGroup(r, 2), expt_dp=pg.expt_dp)
        mine = MegatronGroupedMLP(E, etp_config, max_rows=MAX_ROWS, pg_collection=groups)
        shard = {}
        for i, m in enumerate(ref.local_experts):
            shard[f"linear_fc1.weight{i}"] = m.linear_fc1.weight.detach()[fc1_rows(r)]
            shard[f"linear_fc2.weight{i}"] = m.linear_fc2.weight.detach()[:, r * half:(r + 1) * half]
        mine.load_state_dict(shard, strict=True)
        xm = x.clone().requires_grad_()
        y, _ = mine(xm, counts, probs)
        y.backward(dy)
        y_sum, dx_sum = y_sum + y.float(), dx_sum + xm.grad.float()
        for i, m in enumerate(ref.local_experts):
            check_close(f"rank {r} expert {i} fc1 weight gradient", getattr(mine.linear_fc1, f"weight{i}").grad,
                        m.linear_fc1.weight.grad[fc1_rows(r)])
            check_close(f"rank {r} expert {i} fc2 weight gradient", getattr(mine.linear_fc2, f"weight{i}").grad,
                        m.linear_fc2.weight.grad[:, r * half:(r + 1) * half])
    check_close("sum of the ranks' outputs", y_sum, y_ref.float())
    check_close("sum of the ranks' input gradients", dx_sum, xr.grad.float())


def test_initialisation_follows_megatron():
    """With a TransformerConfig the experts' weights are drawn by its init_method (fc1) and
    output_layer_init_method (fc2), from Megatron's expert-parallel random stream (the default CUDA
    stream, which replicated parameters rely on, is left as it was)."""
    config = make_config(init_method_std=0.5)  # fc2: 0.5 / sqrt(2 x num_layers)
    before = torch.cuda.get_rng_state()
    experts = MegatronGroupedMLP(E, config, max_rows=MAX_ROWS, pg_collection=get_default_pg_collection())
    assert torch.equal(torch.cuda.get_rng_state(), before), "the experts drew from the default CUDA stream"
    w1 = torch.stack(experts.expert_params("fc1", "weight")).float()
    w2 = torch.stack(experts.expert_params("fc2", "weight")).float()
    assert abs(w1.std().item() / 0.5 - 1) < 0.05, w1.std().item()
    assert abs(w2.std().item() / (0.5 / 2 ** 0.5) - 1) < 0.05, w2.std().item()
    again = MegatronGroupedMLP(E, config, max_rows=MAX_ROWS, pg_collection=get_default_pg_collection())
    assert not torch.equal(torch.stack(again.expert_params("fc1", "weight")).float(), w1)  # the stream moves on


@pytest.mark.parametrize("gated", [True, False])
def test_distributed_checkpoint_round_trip_with_sequential_mlp(gated, tmp_path):
    from megatron.core import dist_checkpointing
    config = make_config(bias=True, gated_linear_unit=gated, activation_func=F.silu if gated else squared_relu)
    ref = randomized_reference(config, seed=23)
    want = expert_tensors(ref, "data")
    (tmp_path / "sequential").mkdir()
    dist_checkpointing.save(ref.sharded_state_dict(), str(tmp_path / "sequential"))
    for per_expert_weights in (True, False):
        layer = build_layer(config, ours(per_expert_weights))
        layer.load_state_dict(dist_checkpointing.load(layer.sharded_state_dict(), str(tmp_path / "sequential")))
        for key, t in expert_tensors(layer, "data").items():
            assert torch.equal(t, want[key]), f"SequentialMLP checkpoint -> ours (per_expert={per_expert_weights}): {key}"
        out_dir = tmp_path / f"ours_{per_expert_weights}"
        out_dir.mkdir()
        dist_checkpointing.save(layer.sharded_state_dict(), str(out_dir))
        fresh = randomized_reference(config, seed=24)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(out_dir)))
        for key, t in expert_tensors(fresh, "data").items():
            assert torch.equal(t, want[key]), f"our checkpoint (per_expert={per_expert_weights}) -> SequentialMLP: {key}"


def _adam_after_one_step(layer, seed):
    """torch.optim.Adam over the experts' parameters after one step on seeded gradients (zero
    gradients when seed is None: the states exist, all zero)."""
    params = list(layer.experts.parameters())
    g = torch.Generator(device="cuda").manual_seed(seed or 0)
    for q in params:
        q.grad = torch.zeros_like(q) if seed is None else torch.randn(q.shape, device="cuda", generator=g).to(q.dtype)
    opt = torch.optim.Adam(params, lr=1e-3)
    opt.step()
    return opt


def _sharded_optimizer_state(layer, opt):
    """The optimizer's state dict with each parameter's states placed as that parameter's checkpoint
    entries, as Megatron's (non-distributed) optimizers save it: the parameter found by identity."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)
    params = list(layer.experts.parameters())
    id_map = get_param_id_to_sharded_param_map(layer.sharded_state_dict(), params)
    assert sorted(id_map) == list(range(len(params))), \
        f"{len(params) - len(id_map)} of {len(params)} parameters have no checkpoint entry holding them"
    sd = opt.state_dict()
    step = next(iter(sd["state"].values()))["step"]
    optim_state_to_sharding_state(sd, id_map, exclude_keys=("step",))
    sd["state"]["common_step"] = step  # Megatron's optimizers save one step for all parameters
    return sd


def _load_optimizer_state(opt, loaded):
    """As MegatronOptimizer.load_state_dict: the common step given back to every parameter."""
    step = loaded["state"].pop("common_step")
    for param_state in loaded["state"].values():
        param_state["step"] = step.clone()
    opt.load_state_dict(loaded)


def test_distributed_checkpoint_optimizer_state_across_layouts(tmp_path):
    # A grouped parameter's entry holds the parameter itself, so the optimizer maps its states too;
    # states saved from one layout load into the other, expert by expert.
    from megatron.core import dist_checkpointing
    config = make_config(bias=True)
    ref = randomized_reference(config, seed=25)
    for src_per_expert in (False, True):
        src = our_layer(config, ref, per_expert_weights=src_per_expert)
        src_opt = _adam_after_one_step(src, seed=26)
        want = {k: torch.stack([src_opt.state[q][k] for q in qs]) if len(qs) > 1 else src_opt.state[qs[0]][k]
                for k in ("exp_avg", "exp_avg_sq")
                for qs in [src.experts.expert_params("fc1", "weight")]}
        out_dir = tmp_path / f"optimizer_{src_per_expert}"
        out_dir.mkdir()
        dist_checkpointing.save({"optimizer": _sharded_optimizer_state(src, src_opt)}, str(out_dir))
        dst = our_layer(config, ref, per_expert_weights=not src_per_expert)
        dst_opt = _adam_after_one_step(dst, seed=None)
        loaded = dist_checkpointing.load({"optimizer": _sharded_optimizer_state(dst, dst_opt)}, str(out_dir))
        _load_optimizer_state(dst_opt, loaded["optimizer"])
        qs = dst.experts.expert_params("fc1", "weight")
        for k, t in want.items():
            got = torch.stack([dst_opt.state[q][k] for q in qs]) if len(qs) > 1 else dst_opt.state[qs[0]][k]
            assert torch.equal(got, t), f"fc1.weight {k}: per_expert={src_per_expert} -> {not src_per_expert}"


def test_flattened_range_request_names_the_formats_that_work():
    # The distributed optimizer's fully_sharded_model_space format replaces an entry's data by a
    # flat slice of the optimizer state; megatron-core 0.19's ShardedTensor refuses that for every
    # parameter (SequentialMLP's too), and the grouped entry says which formats save instead.
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    layer = our_layer(make_config(), randomized_reference(make_config(), seed=27), per_expert_weights=False)
    factories = [v for v in layer.sharded_state_dict().values() if isinstance(v, ShardedTensorFactory)]
    assert factories, "a grouped parameter's checkpoint entry is a ShardedTensorFactory"
    flat = dataclasses.replace(factories[0], data=factories[0].data.flatten()[5:77], flattened_range=slice(5, 77))
    with pytest.raises(NotImplementedError, match="dp_reshardable.*fully_reshardable"):
        flat.build()
