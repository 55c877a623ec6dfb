"""An experts module usable in place of Megatron-LM's TEGroupedMLP (megatron-core 0.19,
megatron/core/transformer/moe/experts.py), on moe_engine's experts-only op.

    from moe_engine.integrations.megatron import MegatronGroupedMLP
    experts = MegatronGroupedMLP(num_local_experts, config, max_rows=seq_len * micro_batch * topk * ep_size)
    output, output_bias = experts(permuted_local_hidden_states, tokens_per_expert, permuted_probs)

Megatron's token dispatcher has already permuted the rows into expert groups; this module runs the
local experts on them (fc1 + bias, GLU activation x prob, fc2 + bias x prob) and returns
`(output, None)` like TEGroupedMLP.forward. `tokens_per_expert` may live on the CPU or the GPU; the
group offsets are computed on the device (cumsum, int32) with no host synchronisation.

From the TransformerConfig (any object with these attributes; megatron-core is not imported):
  hidden_size, moe_ffn_hidden_size, gated_linear_unit, activation_func (by name: silu, quick_gelu,
  fast_gelu / openai_gelu, squared_relu), glu_linear_offset and activation_func_clamp_value (clamped
  GLU: GPT-OSS is quick_gelu + offset 1 + clamp 7), moe_mlp_glu_interleave_size, add_bias_linear,
  gradient_accumulation_fusion (-> accumulate into param.main_grad), delay_wgrad_compute
  (-> backward_dw()), moe_apply_probs_on_input (topk 1: probs scale the input rows),
  expert_model_parallel_size / expert_tensor_parallel_size / tensor_model_parallel_size (the params'
  `allreduce` attribute), expert_tensor_parallel_size (or pg_collection.expt_tp: this rank holds
  moe_ffn_hidden_size / ETP features of each expert, fc1's rows [gate shard; linear shard] and fc2's
  columns, and returns partial sums that Megatron's dispatcher reduces, as TE's grouped linears do),
  moe_latent_size (must be None), fp8 = "e4m3" with fp8_recipe = "blockwise" (the experts' GEMMs in
  FP8 block scaling: 1x128 / 128x128 blocks as TransformerEngine's Float8BlockScaling, and its
  scales -- powers of two, GroupedExperts(fp8="block_pow2"), unless
  NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 asks for exact fp32 ones, fp8="block" -- with the weights
  quantized in every forward; each call's expert groups are moved onto the 128-row grid the FP8
  weight gradients need and back). Refused with NotImplementedError: latent
  MoE, expert tensor parallelism with biases, expert GTP weight rematerialization, other FP8 recipes
  and formats, fp8_param, fp8_wgrad = False, first_last_layers_bf16, FP4 (`fp4`), erf GELU (F.gelu) as
  a GLU activation.

Parameters are named like TEGroupedLinear's: `linear_fc1.weight0 .. weight{E-1}` ([2F, H]) per
expert (the default, per_expert_weights=True) or one grouped `linear_fc1.weight` [E, 2F, H]; the same
for linear_fc1.bias, linear_fc2.weight ([H, F]) and linear_fc2.bias (F: this rank's share under
expert tensor parallelism). GLU rows: gate then linear, or blocks of moe_mlp_glu_interleave_size
rows. Like TE's, the weights and fc1's bias carry tensor_model_parallel, fc2's bias does not; their
partition_dim is the split dimension of the tensor as it is -- fc1 0, fc2 1 per expert, 1 and 2 on
a grouped [E, out, in] tensor (TE gives its single grouped weight 0 / 1, counting the expert axis).
With a Megatron TransformerConfig the weights are drawn by its init_method (fc1) and
output_layer_init_method (fc2) from the expert-parallel random stream (_initialize_like_megatron).

Megatron's data-parallel wrapper (DistributedDataParallel) meets this module as it meets TE's:
  - gradient_accumulation_fusion: weight gradients are added into `param.main_grad`; the backward
    still returns a placeholder gradient (uninitialised, or zeros when `param.zero_out_wgrad`) for
    every parameter that carries `grad_added_to_main_grad`, and sets that flag, so that DDP's
    per-parameter hooks on the gradient accumulators fire and skip the add -- what Megatron's own
    layers do;
  - delay_wgrad_compute: the parameters carry `skip_backward_post_hook`; DDP then registers one
    hook per parameter with `register_wgrad_accumulation_and_reduce_hooks(hook)` on the module that
    holds it -- here `linear_fc1` / `linear_fc2`, as on TE's grouped linears (DDP registers a hook on
    every module in the tree that has the method and holds the parameter, so the outer module must
    not have it) -- and `backward_dw()` calls them once the weight gradients of the oldest pending
    backward are final: fc2's hooks, then fc1's.

Megatron builds its experts from `MoESubmodules.experts`, a callable taking
`(num_local_experts, config, *, pg_collection, name)`; this class takes that call as it is:
    MoESubmodules(experts=functools.partial(MegatronGroupedMLP, max_rows=...), ...)

Checkpoints (plain state dicts; `load_state_dict` and the helpers below): grouped <-> per-expert
(`linear_fc1.weight` <-> `linear_fc1.weight{i}`), and SequentialMLP's spelling
`local_experts.{i}.linear_fc1.weight` in either direction of the load. The linears' `_extra_state`
entries (None from Megatron's local linears, FP8 scaling metadata from TE's) are dropped on load:
the experts keep no scaling state (FP8 block scales are computed anew in every forward). Optimizer
states keyed by parameter name convert the same way (`normalize_optimizer_state`).

Megatron's distributed checkpoint (`sharded_state_dict`, which MoELayer calls): the ShardedTensors
SequentialMLP and TEGroupedMLP write -- each expert at its global index, the GLU halves split as
Megatron splits them -- so dist_checkpointing files move between the three experts modules and
between expert-parallel sizes; a grouped parameter is one factory entry holding the parameter, so
optimizer states map to it too (megatron_sharded_state_dict)."""
import contextlib
import copy
import os
import re

import torch
from torch import nn

from ..module import _FP8_ALIGN, GroupedExperts
from ..state_dict import EXPERT_DIMS, normalize_expert_keys, split_experts

_OWNERS = ("linear_fc1", "linear_fc2")


def _activation_from_config(config):
    """(activation, alpha, limit, offset) of moe_engine for the config's expert MLP."""
    fn = config.activation_func
    name = getattr(fn, "__name__", type(fn).__name__)
    gated = bool(config.gated_linear_unit)
    offset = float(getattr(config, "glu_linear_offset", 0.0) or 0.0)
    clamp = getattr(config, "activation_func_clamp_value", None)
    if not gated:
        if name == "squared_relu" and clamp is None:
            return "squared-relu", 1.702, 7.0, 1.0
        raise NotImplementedError(f"moe_engine: activation_func {name} without gated_linear_unit; supported: squared_relu")
    if name in ("silu", "quick_gelu"):
        alpha = 1.0 if name == "silu" else 1.702
        if clamp is None and offset == 0.0 and name == "silu":
            return "swiglu", 1.702, 7.0, 1.0
        if clamp is None:
            raise NotImplementedError(f"moe_engine: GLU activation {name} with glu_linear_offset={offset} needs "
                                      "activation_func_clamp_value (moe_engine's clamped SwiGLU always clamps)")
        # glu(): act(clamp(g, max=c)) * (clamp(l, -c, c) + offset), act(x) = x * sigmoid(alpha x).
        return "clamped-swiglu", alpha, float(clamp), offset
    if name in ("fast_gelu", "openai_gelu", "gelu_impl"):
        if clamp is not None or offset != 0.0:
            raise NotImplementedError("moe_engine: a tanh-GELU GLU with clamp or offset is not supported")
        return "geglu", 1.702, 7.0, 1.0
    raise NotImplementedError(
        f"moe_engine: GLU activation_func {name} is not supported; supported: silu (swiglu, clamped with "
        "activation_func_clamp_value), quick_gelu with a clamp (GPT-OSS), fast_gelu / openai_gelu (tanh GELU: geglu); "
        "F.gelu is the erf GELU, which moe_engine does not implement")


def _expert_tp_size(config, pg_collection):
    """The expert-tensor-parallel size: the config's expert_tensor_parallel_size (which Megatron's
    TransformerConfig sets to tensor_model_parallel_size when it is left None), checked against the
    size of pg_collection.expt_tp when that is given."""
    size = getattr(config, "expert_tensor_parallel_size", None) or getattr(config, "tensor_model_parallel_size", 1) or 1
    group = getattr(pg_collection, "expt_tp", None)
    if group is not None and group.size() != size:
        raise ValueError(f"moe_engine: pg_collection.expt_tp has {group.size()} ranks but the config's expert tensor "
                         f"parallel size is {size}")
    return size


def _local_ffn(config, etp):
    """The expert FFN width this rank holds: moe_ffn_hidden_size / etp (fc1's output features and
    fc2's input features are split over the expert-tensor-parallel ranks, as TE's grouped linears
    split them)."""
    ffn = config.moe_ffn_hidden_size
    if etp > 1:
        if ffn % etp:
            raise ValueError(f"moe_engine: moe_ffn_hidden_size {ffn} is not divisible by the expert tensor parallel "
                             f"size {etp}")
        interleave = getattr(config, "moe_mlp_glu_interleave_size", None)
        if interleave and (ffn // etp) % interleave:
            raise ValueError(f"moe_engine: moe_mlp_glu_interleave_size {interleave} does not divide this rank's "
                             f"{ffn // etp} features (moe_ffn_hidden_size {ffn} / expert tensor parallel size {etp})")
        if config.add_bias_linear:
            raise NotImplementedError("moe_engine: expert tensor parallelism with add_bias_linear is not supported "
                                      "(fc2's bias is replicated over the expert-tensor-parallel ranks, whose "
                                      "outputs are partial sums)")
    return ffn // etp


# FP8 blocks need each expert's rows to start on a multiple of this (the weight gradients reduce over
# 128-token scale blocks); Megatron's dispatcher packs the groups back to back.
_FP8_ROWS = _FP8_ALIGN["block"]  # "block_pow2" alike


def _rows_on_fp8_grid(rows, experts):
    """The most rows `rows` packed rows of `experts` groups take once each group starts on the grid."""
    return -(-(rows + experts * (_FP8_ROWS - 1)) // _FP8_ROWS) * _FP8_ROWS


def _fp8_from_config(config):
    """The experts' quantization from Megatron's FP8 options: for config.fp8 = "e4m3" with
    config.fp8_recipe = "blockwise", TransformerEngine's Float8BlockScaling (1x128 blocks for tokens
    and gradients, 128x128 for weights, E4M3 throughout) with its scales: "block_pow2" (powers of two,
    its default), or "block" (exact fp32 scales) when NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 is set, the
    variable TransformerEngine reads; None without config.fp8; anything else is refused by name."""
    if getattr(config, "fp4", None):
        raise NotImplementedError("moe_engine: config.fp4 is set; the experts run in bf16 or FP8 block scaling")
    fmt = getattr(config, "fp8", None)
    if not fmt:
        return None
    recipe = str(getattr(config, "fp8_recipe", "delayed")).lower().split(".")[-1]
    if recipe != "blockwise":
        raise NotImplementedError(f"moe_engine: config.fp8_recipe {recipe!r}; the FP8 experts implement the "
                                  "\"blockwise\" recipe (1x128 / 128x128 blocks, DeepSeek-V3's)")
    if str(fmt).lower() != "e4m3":
        raise NotImplementedError(f"moe_engine: config.fp8 {fmt!r}; the blockwise FP8 experts use E4M3 for "
                                  "tokens, weights and gradients (\"e4m3\")")
    if getattr(config, "fp8_wgrad", True) is False:
        raise NotImplementedError("moe_engine: config.fp8_wgrad = False (weight gradients in higher precision) is "
                                  "not offered; the FP8 experts compute their weight gradients in FP8")
    if getattr(config, "first_last_layers_bf16", False):
        raise NotImplementedError("moe_engine: config.first_last_layers_bf16 is not supported: the experts module "
                                  "does not know its layer number, so it cannot run the first and last layers in bf16")
    if getattr(config, "fp8_param", False):
        raise NotImplementedError("moe_engine: config.fp8_param (FP8 parameters) is not supported; the FP8 experts "
                                  "quantize their bf16 weights in every forward")
    return "block" if os.environ.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1" else "block_pow2"


def _check_config(config):
    if getattr(config, "moe_latent_size", None) is not None:
        raise NotImplementedError("moe_engine: config.moe_latent_size (latent MoE) is not supported")
    if (getattr(config, "expert_gtp_weight_remat_size", 1) or 1) > 1:
        raise NotImplementedError("moe_engine: expert GTP weight rematerialization (expert_tensor_parallel_num_weight_"
                                  "shards above expert_tensor_parallel_size) is not supported")
    interleave = getattr(config, "moe_mlp_glu_interleave_size", None)
    if interleave is not None and not config.gated_linear_unit:
        raise ValueError("moe_engine: moe_mlp_glu_interleave_size needs gated_linear_unit")


class _LinearOwner(nn.Module):
    """Holds linear_fc1's (or linear_fc2's) parameters and, like TE's grouped linears, the hooks
    Megatron's DDP registers for them under delay_wgrad_compute."""

    def __init__(self):
        super().__init__()
        self._wgrad_accumulation_and_reduce_hooks = []

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        """Megatron DDP (delay_wgrad_compute): hook() for one of this module's parameters, called
        by the experts module's backward_dw() once that parameter's gradient is final."""
        self._wgrad_accumulation_and_reduce_hooks.append(hook)

    def _trigger_wgrad_accumulation_and_reduce_hooks(self):
        for hook in self._wgrad_accumulation_and_reduce_hooks:
            hook()


class MegatronGroupedMLP(GroupedExperts):
    """TEGroupedMLP's place in a Megatron MoE layer, on moe_engine.GroupedExperts.

    MegatronGroupedMLP(num_local_experts, config, submodules=None, pg_collection=None, name=None,
    max_rows=None, per_expert_weights=True, device=None, init_std=None): the first five arguments are
    TEGroupedMLP's (submodules and name are accepted and not used; pg_collection gives
    sharded_state_dict its expert groups). `max_rows` bounds the permuted rows of one call
    (workspaces are sized for it once): at most tokens per micro-batch x moe_router_topk x
    expert-parallel size in a dropless setting, x ETP / TP under expert tensor parallelism (the
    dispatcher gathers over the expert-tensor-and-expert-parallel group); when it is None,
    `config.moe_engine_max_rows` is read. It holds Megatron's process groups, as Megatron's own experts
    modules do, so it is neither deep-copied nor pickled."""

    _OWNER_NAMES = {"fc1": _OWNERS[0], "fc2": _OWNERS[1]}
    _OWNER_CLASS = _LinearOwner

    def __init__(self, num_local_experts, config, submodules=None, pg_collection=None, name=None, max_rows=None,
                 per_expert_weights=True, device=None, init_std=None):
        _check_config(config)
        if max_rows is None:
            max_rows = getattr(config, "moe_engine_max_rows", None)
        if max_rows is None:
            raise ValueError("argument 'max_rows': the bound on permuted rows per call is needed (pass max_rows= "
                             "or set config.moe_engine_max_rows): tokens per micro-batch x topk x EP size "
                             "(x ETP / TP with expert tensor parallelism)")
        activation, alpha, limit, offset = _activation_from_config(config)
        interleave = getattr(config, "moe_mlp_glu_interleave_size", None) or 0
        apply_probs_on_input = bool(getattr(config, "moe_apply_probs_on_input", False))
        if apply_probs_on_input and getattr(config, "moe_router_topk", 1) != 1:
            raise ValueError("moe_engine: moe_apply_probs_on_input only works with moe_router_topk=1 (as in Megatron)")
        accumulate = bool(getattr(config, "gradient_accumulation_fusion", False))
        delay = bool(getattr(config, "delay_wgrad_compute", False))
        fp8 = _fp8_from_config(config)
        # FP8: each call's groups are moved onto the 128-row grid, which adds up to 127 rows an expert.
        op_rows = max_rows if fp8 is None else _rows_on_fp8_grid(max_rows, num_local_experts)
        etp = _expert_tp_size(config, pg_collection)
        # Megatron's initialisation replaces the module's own (which would draw from the default CUDA
        # stream) unless init_std is given.
        megatron_init = (init_std is None and getattr(config, "init_method", None) is not None and
                         getattr(config, "perform_initialization", True))
        super().__init__(config.hidden_size, _local_ffn(config, etp), num_local_experts, op_rows,
                         activation=activation, glu_interleave=interleave, bias=bool(config.add_bias_linear),
                         per_expert_weights=per_expert_weights, accumulate_into_main_grad=accumulate, delay_wgrad=delay,
                         clamp_alpha=alpha, clamp_limit=limit, clamp_offset=offset, device=device,
                         init_std=0.0 if megatron_init else init_std, fp8=fp8)
        self.config = config
        self.num_local_experts = num_local_experts
        self.pg_collection = pg_collection  # the expert groups of Megatron's distributed checkpoint
        self.max_rows = max_rows
        self.max_rows_on_grid = op_rows  # FP8: the rows of one call once its groups are on the 128-row grid
        self.apply_probs_on_input = apply_probs_on_input
        self.expert_tensor_parallel_size = etp
        # TE's expert parameters (extensions/transformer_engine.py, _set_expert_parameter_attributes):
        # allreduce=False routes their gradients to the expert-data-parallel buckets of Megatron's DDP;
        # the weights, and fc1's bias, are marked as split over tensor parallelism (fc1 column-parallel
        # on its output rows, fc2 row-parallel on its input columns; fc2's bias is replicated), so that
        # every shard counts in the gradient norm and resharding finds the split dimension.
        use_expert_pgs = ((getattr(config, "expert_model_parallel_size", 1) or 1) > 1 or
                          etp != (getattr(config, "tensor_model_parallel_size", 1) or 1))
        if megatron_init:
            self._initialize_like_megatron(config)
        for owner, column in ((self.linear_fc1, True), (self.linear_fc2, False)):
            for name, q in owner.named_parameters():
                q.allreduce = not use_expert_pgs
                if delay:
                    q.skip_backward_post_hook = True
                is_weight = name.startswith("weight")
                q.tensor_model_parallel = is_weight or column
                if q.tensor_model_parallel:
                    # The split dimension of one expert's [out, in] tensor, one further on a grouped [E, ...] one.
                    q.partition_dim = (0 if column else 1) + (0 if per_expert_weights else 1)
                    q.partition_stride = 1

    def _initialize_like_megatron(self, config):
        """With a Megatron TransformerConfig (init_method set, perform_initialization on) the weights are
        drawn as Megatron's expert linears draw theirs: fc1 by config.init_method, fc2 by
        config.output_layer_init_method, biases zero, from Megatron's expert-parallel random stream
        when its tracker is seeded (model_parallel_cuda_manual_seed seeds it per expert-parallel and
        expert-tensor-parallel rank, so the ranks' experts and shards differ, and the default stream,
        which the replicated parameters rely on, is left as it was). Otherwise (a duck-typed config)
        the module's own initialisation stays (as it does when init_std is given)."""
        init = config.init_method
        fork = contextlib.nullcontext()
        try:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
        except ImportError:
            pass
        else:
            tracker = get_cuda_rng_tracker()
            if tracker.is_initialized():
                fork = tracker.fork(get_expert_parallel_rng_tracker_name())
        out_init = getattr(config, "output_layer_init_method", None) or init
        with torch.no_grad(), fork:
            for owner, fn in ((self.linear_fc1, init), (self.linear_fc2, out_init)):
                for name, q in owner.named_parameters():
                    if name.startswith("weight"):
                        fn(q)
                    else:
                        q.zero_()

    # -- Megatron's forward -------------------------------------------------------------------
    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, output_buffer=None,
                grad_input_buffer=None):
        """(output [rows, H], None), TEGroupedMLP's signature. permuted_probs [rows] (any float dtype)."""
        if output_buffer is not None or grad_input_buffer is not None:
            raise NotImplementedError("moe_engine: output_buffer / grad_input_buffer (NCCL-EP zero copy) are not supported")
        x = permuted_local_hidden_states
        rows = x.shape[0]
        offsets = group_offsets(tokens_per_expert, x.device)
        if offsets.shape[0] != self.num_experts + 1:
            raise ValueError(f"argument 'tokens_per_expert': expected {self.num_experts} counts (the local experts), "
                             f"got {offsets.shape[0] - 1}")
        probs = permuted_probs.reshape(rows).float()
        if self.apply_probs_on_input:
            # Megatron: x = (probs * x).to(x.dtype), then probs = 1.
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        x = x.to(torch.bfloat16).contiguous()
        if self.fp8 is None:
            out = super().forward(x, offsets, probs.contiguous())
        else:
            out = self._forward_on_fp8_grid(x, offsets, probs)
        return out.to(permuted_local_hidden_states.dtype), None

    def _forward_on_fp8_grid(self, x, offsets, probs):
        """The FP8 experts on rows moved so that each expert's group starts on a multiple of 128 (zero
        rows with zero probs between the groups, which add nothing to any output or gradient), then
        the rows moved back; on the device, without a host sync (graph-safe)."""
        rows, E = x.shape[0], self.num_experts
        if rows > self.max_rows:
            raise ValueError(f"argument 'permuted_local_hidden_states': {rows} rows, above max_rows = {self.max_rows}")
        # The grid for this call (host integers: fixed per captured graph): every group rounded up to 128.
        grid_rows = min(self.max_rows_on_grid, _rows_on_fp8_grid(rows, E))
        counts = offsets[1:] - offsets[:-1]
        padded = torch.zeros(E + 1, dtype=torch.int32, device=x.device)
        torch.cumsum((counts + _FP8_ROWS - 1) // _FP8_ROWS * _FP8_ROWS, 0, dtype=torch.int32, out=padded[1:])
        # Row r of group e moves by padded[e] - offsets[e]; rows past the last group (in no group, so
        # neither read nor written, as without FP8) follow the last padded group.
        r = torch.arange(rows, dtype=torch.int32, device=x.device)
        group = torch.searchsorted(offsets[1:], r, right=True)
        dest = r.long() + (padded - offsets).long()[group]
        x_grid = x.new_zeros(grid_rows, x.shape[1]).index_copy(0, dest, x)
        p_grid = probs.new_zeros(grid_rows).index_copy(0, dest, probs)
        return super().forward(x_grid, padded, p_grid).index_select(0, dest)

    # -- Megatron DDP interplay ----------------------------------------------------------------
    def _after_backward(self, run_backward, keep_for_dw, wants_param_grads=True):
        # Megatron's DDP gives every parameter `grad_added_to_main_grad` (False) when it wraps the
        # model; read before the op's backward sets it.
        under_ddp = [hasattr(q, "grad_added_to_main_grad") for q in self._flat_params()]
        outs, grads = super()._after_backward(run_backward, keep_for_dw, wants_param_grads)
        if self.accumulate_into_main_grad and not self.delay_wgrad:
            # Placeholders only where a gradient is wanted (frozen experts get none).
            grads = [self._placeholder_grad(q) if ddp and q.requires_grad else None
                     for q, ddp in zip(self._flat_params(), under_ddp)]
        return outs, grads

    @staticmethod
    def _placeholder_grad(q):
        """What Megatron's own layers return with gradient accumulation fusion: a gradient that only
        makes autograd run the accumulator (and DDP's hook on it, which drops it), main_grad already
        holding the sum."""
        if getattr(q, "zero_out_wgrad", False):
            return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    def _mark_main_grad(self):
        # As TE's layers do: the flag is set where DDP put it (False), never created -- its presence
        # is how _after_backward and backward_dw tell a DDP-managed parameter.
        for q in self._flat_params():
            if hasattr(q, "grad_added_to_main_grad"):
                q.grad_added_to_main_grad = True

    def backward_dw(self):
        """Delayed mode: the weight gradients of the oldest pending backward (fc2's, then fc1's),
        then the wgrad hooks (register_wgrad_hook's, then DDP's on linear_fc2, then on linear_fc1),
        as TEGroupedMLP.backward_dw does. MoELayer.backward_dw() calls it.

        With gradient accumulation fusion, each DDP-managed parameter gets the placeholder gradient
        first (as TE's layers leave one from their backward): DDP's hook asserts that param.grad is
        set when it overlaps the gradient reduction, and drops it."""
        super().backward_dw()
        if self.accumulate_into_main_grad:
            for q in self._flat_params():  # frozen experts (no parameter requiring a gradient) get none
                if hasattr(q, "grad_added_to_main_grad") and q.requires_grad and q.grad is None:
                    q.grad = self._placeholder_grad(q)
        self.linear_fc2._trigger_wgrad_accumulation_and_reduce_hooks()
        self.linear_fc1._trigger_wgrad_accumulation_and_reduce_hooks()

    # -- checkpoints ---------------------------------------------------------------------------
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's distributed checkpoint (`dist_checkpointing`): the ShardedTensors SequentialMLP
        and TEGroupedMLP write, so a checkpoint moves between the three experts modules and between
        expert-parallel sizes. MoELayer.sharded_state_dict() calls it."""
        params = {(owner, what): self.expert_params(p, what) for p, owner in self._OWNER_NAMES.items()
                  for what in ("weight", "bias") if what == "weight" or self.has_bias}
        return megatron_sharded_state_dict(params, self.num_local_experts, bool(self.config.gated_linear_unit),
                                           prefix, sharded_offsets, metadata, self.pg_collection)

    def _normalize_keys(self, state_dict, prefix, *args, **kwargs):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if _EXTRA_STATE.fullmatch(key[len(prefix):]):
                del state_dict[key]
        sequential_to_grouped_keys(state_dict, prefix, self.num_local_experts)
        super()._normalize_keys(state_dict, prefix, *args, **kwargs)
        if not self.per_expert_weights:
            # TE's single grouped weight may be stored as [E * out, in]: view it as [E, out, in].
            for p in ("fc1", "fc2"):
                for s in ("weight", "bias"):
                    key = f"{prefix}{self._OWNER_NAMES[p]}.{s}"
                    t = state_dict.get(key)
                    expert_shape = self._shapes[(p, s)]
                    flat = (self.num_experts * expert_shape[0], *expert_shape[1:])
                    if isinstance(t, torch.Tensor) and tuple(t.shape) == flat:
                        state_dict[key] = t.reshape(self.num_experts, *expert_shape)


def group_offsets(tokens_per_expert, device):
    """int32 [E + 1] exclusive prefix sum of tokens_per_expert, on `device`, without a host sync
    (a CPU tensor or list is copied to the device; a device tensor stays there)."""
    counts = torch.as_tensor(tokens_per_expert)
    if counts.device != device:
        counts = counts.to(device, non_blocking=True)
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=device)
    torch.cumsum(counts.reshape(-1), 0, dtype=torch.int32, out=out[1:])
    return out


_EXTRA_STATE = re.compile(r"(local_experts\.\d+\.)?linear_fc[12]\._extra_state\d*")
_SEQUENTIAL = re.compile(r"local_experts\.(0|[1-9]\d*)\.(linear_fc[12])\.(weight|bias)$")


def megatron_sharded_state_dict(params, num_local_experts, gated, prefix="", sharded_offsets=(), metadata=None,
                                pg_collection=None):
    """The sharded state dict of local experts as megatron-core's SequentialMLP builds it (whose
    layout TEGroupedMLP shares): for local expert i, at global index g = EP rank x num_local_experts
    + i, the ShardedTensors `{prefix}experts.linear_fc1.weight` [2F, H] (and `.bias`, and the same for
    linear_fc2) placed at g on an axis prepended for the experts, the GLU weight and bias split into
    their two halves (Megatron's SwiGLU factory), fc1 sharded over tensor parallelism on its rows and
    fc2 on its columns, the linears' `_extra_state` as None objects (Megatron's local linears' value),
    and the expert-data-parallel rank as replica id. `singleton_local_shards` in metadata gives each
    expert its own keys (`{prefix}experts.{g}.linear_fc1.weight`) instead.

    params: {(owner, what): tensors} for owner linear_fc1 / linear_fc2 and what weight / bias (a
    parameter left out does not exist): tensors is the list of the local experts' tensors, keyed
    `{prefix}linear_fcN.{what}{i}`, or a one-element list holding the grouped [E, ...] tensor, keyed
    `{prefix}linear_fcN.{what}` and entered as one ShardedTensorFactory whose data is that tensor
    and which builds the same per-expert ShardedTensors (Megatron's optimizers find a parameter's
    entry by the identity of its data, so the entry of a grouped parameter must hold the parameter
    itself). `_extra_state` entries are keyed `{prefix}linear_fcN._extra_state{i}`. Both spellings
    are what load_state_dict reads in either parameter layout. pg_collection: the
    ProcessGroupCollection Megatron built the experts with (its ep, expt_tp and expt_dp groups), or
    None for Megatron's default groups. Needs megatron-core."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    if pg_collection is None:
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
        pg_collection = get_default_pg_collection()
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton_local_shards = metadata.get("singleton_local_shards", False)
    num_global_experts = pg_collection.ep.size() * num_local_experts
    first_global_expert = pg_collection.ep.rank() * num_local_experts
    tp_axes = {"linear_fc1": {"weight": 0, "bias": 0}, "linear_fc2": {"weight": 1}}

    def expert_entries(owner, tensors, i):
        """{"linear_fcN.weight": entry, ...} of local expert i: what SequentialMLP's expert MLP and
        its linears return, with SequentialMLP's expert prefix and replica ids."""
        g = first_global_expert + i
        if singleton_local_shards:
            expert_prefix, offsets = f"{prefix}experts.{g}.", tuple(sharded_offsets)
        else:
            expert_prefix = f"{prefix}experts."
            offsets = (*sharded_offsets, (len(sharded_offsets), g, num_global_experts))
        sub = make_sharded_tensors_for_checkpoint(tensors, f"{owner}.", tp_axes[owner], offsets,
                                                  tp_group=pg_collection.expt_tp, dp_cp_group=metadata["dp_cp_group"])
        if owner == "linear_fc1" and gated:
            for what in ("weight", "bias"):
                if f"{owner}.{what}" in sub:
                    sub[f"{owner}.{what}"] = apply_swiglu_sharded_factory(
                        sub[f"{owner}.{what}"], offsets, singleton_local_shards, tp_group=pg_collection.expt_tp,
                        dp_group=metadata["dp_cp_group"])
        replace_prefix_for_sharding(sub, f"{owner}.", f"{expert_prefix}{owner}.")
        for entry in sub.values():
            # Replicas of an expert are the ranks of its expert-data-parallel group.
            entry.replica_id = (*entry.replica_id[:2], pg_collection.expt_dp.rank())
        return sub

    def grouped_factory(owner, what, grouped):
        name = f"{owner}.{what}"
        base = f"{prefix}experts.{name}"  # the factory's key; the entries it builds carry their own

        def build(key, data, replica_id, flattened_range):
            # key: base, or base under an optimizer prefix (optimizer states are built from a copy of
            # this factory holding the state tensor): the entries' keys take the same prefix.
            if flattened_range is not None:
                raise NotImplementedError(
                    f"moe_engine: '{base}' asks for a flattened range (the distributed optimizer's "
                    "'fully_sharded_model_space' format, whose flattened ranges megatron-core 0.19 refuses for "
                    "every parameter): save with metadata['distrib_optim_sharding_type'] = 'dp_reshardable' or "
                    "'fully_reshardable'")
            if not key.endswith(base):
                raise ValueError(f"moe_engine: factory key '{key}' does not end with '{base}'")
            outer = key[:len(key) - len(base)]
            pieces = []
            for i in range(num_local_experts):
                entry = expert_entries(owner, {what: data[i]}, i)[name]
                parts = entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]
                for part in parts:
                    part.key = outer + part.key
                    part.replica_id = replica_id
                pieces.append(parts)
            return pieces

        def merge(pieces):
            return torch.stack([torch.cat(parts) if len(parts) > 1 else parts[0] for parts in pieces])

        replica_id = expert_entries(owner, {what: grouped[0]}, 0)[name].replica_id
        return ShardedTensorFactory(base, grouped, build, merge, replica_id)

    sharded = {}
    for owner in _OWNERS:
        per_expert = {}
        for what in ("weight", "bias"):
            tensors = params.get((owner, what))
            if tensors is None:
                continue
            if len(tensors) == 1 and tensors[0].dim() == (3 if what == "weight" else 2):  # grouped [E, ...]
                sharded[f"{prefix}{owner}.{what}"] = grouped_factory(owner, what, tensors[0])
            else:
                per_expert[what] = tensors
        for i in range(num_local_experts):
            local = {what: tensors[i] for what, tensors in per_expert.items()}
            local["_extra_state"] = None
            for name, entry in expert_entries(owner, local, i).items():  # name: "linear_fcN.weight" etc.
                sharded[f"{prefix}{name}{i}"] = entry
    return sharded


def sequential_to_grouped_keys(state_dict, prefix, num_experts):
    """Rewrites SequentialMLP keys `{prefix}local_experts.{i}.linear_fcN.{weight|bias}` into
    TEGroupedMLP's per-expert keys `{prefix}linear_fcN.{weight|bias}{i}` in place (a key already
    present is never overwritten; ids >= num_experts raise KeyError)."""
    moves = []
    for key in [k for k in state_dict if k.startswith(prefix)]:
        m = _SEQUENTIAL.fullmatch(key[len(prefix):])
        if m is None:
            continue
        i, owner, what = int(m.group(1)), m.group(2), m.group(3)
        if i >= num_experts:  # checked for every key before any moves: an error leaves the dict as it was
            raise KeyError(f"'{key}': expert {i} out of range for {num_experts} local experts")
        moves.append((key, f"{prefix}{owner}.{what}{i}"))
    for key, target in moves:
        if target not in state_dict:
            state_dict[target] = state_dict.pop(key)
    return state_dict


def grouped_to_sequential_keys(state_dict, prefix, num_experts):
    """The inverse spelling: `{prefix}linear_fcN.{weight|bias}` (grouped, split first) or
    `{prefix}linear_fcN.{weight|bias}{i}` -> `{prefix}local_experts.{i}.linear_fcN.{weight|bias}`
    (a key already present is never overwritten)."""
    normalize_expert_keys(state_dict, prefix, num_experts, per_expert=True, params=_OWNERS)
    for owner in _OWNERS:
        for what in ("weight", "bias"):
            for i in range(num_experts):
                key, target = f"{prefix}{owner}.{what}{i}", f"{prefix}local_experts.{i}.{owner}.{what}"
                if key in state_dict and target not in state_dict:
                    state_dict[target] = state_dict.pop(key)
    return state_dict


def normalize_optimizer_state(state, prefix, num_experts, per_expert):
    """Optimizer state keyed by parameter name (e.g. {name: {"exp_avg": t, "exp_avg_sq": t, "step": s}},
    as Megatron's per-expert `linear_fc1.weight{i}` entries, or SequentialMLP's names) converted to
    the module's layout in place, like load_state_dict does for the parameters: each tensor field of
    the parameter's grouped shape ([E, ...], or TE's flat [E * out, in]) is stacked / split per
    expert; other fields (step, scalars) must agree between the experts and are kept once, or given
    to each expert as a copy of its own. Every expert's entry must have the same fields."""
    sequential_to_grouped_keys(state, prefix, num_experts)
    for owner in _OWNERS:
        for what in ("weight", "bias"):
            grouped = f"{prefix}{owner}.{what}"
            parts = [f"{grouped}{i}" for i in range(num_experts)]
            present = [k for k in parts if k in state]
            if not per_expert and present and grouped not in state:
                missing = [k for k in parts if k not in state]
                if missing:
                    raise KeyError(f"cannot fold per-expert optimizer state into '{grouped}': missing {missing}")
                entries = [state[k] for k in parts]
                for k, e in zip(parts, entries):
                    if not isinstance(e, dict):
                        raise ValueError(f"cannot fold optimizer state '{k}': expected a dict of fields, got "
                                         f"{type(e).__name__}")
                fields = list(dict.fromkeys(f for e in entries for f in e))  # every expert's, in order
                for k, e in zip(parts, entries):
                    lacking = [f for f in fields if f not in e]
                    if lacking:
                        raise KeyError(f"cannot fold optimizer state into '{grouped}': '{k}' has no {lacking}, "
                                       "which other experts have")
                state[grouped] = {f: _fold_field(grouped, f, [e[f] for e in entries]) for f in fields}
                for k in parts:
                    del state[k]
            elif per_expert and not present and grouped in state:
                entry = state.pop(grouped)
                split = {f: split_experts(v, num_experts, EXPERT_DIMS[what]) for f, v in entry.items()}
                for i, k in enumerate(parts):
                    state[k] = {f: (split[f][i].clone() if split[f] is not None else _own_copy(v))
                                for f, v in entry.items()}
    return state


def _own_copy(v):
    # Each expert's entry owns its fields: an optimizer updates some in place (Adam's step tensor).
    return v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _fold_field(name, field, values):
    if isinstance(values[0], torch.Tensor) and values[0].dim() >= 1:
        return torch.stack(values)
    first = values[0]
    for v in values[1:]:
        if isinstance(v, torch.Tensor) and isinstance(first, torch.Tensor):
            same = v.shape == first.shape and bool(torch.eq(v, first).logical_or(v.isnan() & first.isnan()).all())
        else:
            same = v == first or (isinstance(v, float) and isinstance(first, float) and v != v and first != first)
        if not same:
            raise ValueError(f"cannot fold optimizer state '{name}': field '{field}' differs between experts")
    return first
