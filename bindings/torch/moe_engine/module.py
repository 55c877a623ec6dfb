"""GroupedMLP (the expert layer: dispatch, experts, combine) and GroupedExperts (the experts alone,
for rows some other dispatcher placed in expert groups) as torch.nn.Modules.

Parameters live in `fc1` and `fc2` submodules (see docs/semantics.md, weight layouts):
  single grouped:  fc1.weight [E, fc1_out, H], fc1.bias [E, fc1_out], fc2.weight [E, H, F], fc2.bias [E, H]
  per expert:      fc1.weight0 .. fc1.weight{E-1} [fc1_out, H], ... (the same for bias and fc2)
fc1_out = 2F for gated activations (gate rows, then linear rows, or GLU-interleaved blocks of
`glu_interleave` rows), F for squared-relu. load_state_dict accepts either layout.

Weight gradients:
  - default: returned to autograd (param.grad), bf16 or fp32 (`wgrad_dtype`);
  - accumulate_into_main_grad=True (Megatron "gradient accumulation fusion"): added into the fp32
    `param.main_grad` each parameter must carry; autograd gets None and `param.grad_added_to_main_grad`
    is set;
  - delay_wgrad=True: backward produces dx and dprobs only; each `backward_dw()` call later computes
    the weight gradients of the oldest backward not yet completed, fc2's then fc1's.
Hooks registered with `register_wgrad_hook(fn)` are called as fn(name, param) when that parameter's
gradient is final -- the place for a data-parallel reducer's reduce-scatter: with main_grad, at the
end of backward (fc2 before fc1); when delayed, in backward_dw (fc2 before fc1); otherwise once
autograd has accumulated it into param.grad (autograd's order).

State: the modules hold configuration and workspaces only. What a backward needs is returned by
the forward as tensors that autograd keeps (PyTorch's caching allocator, so it works inside
torch.cuda.graph), so any number of forwards may be in flight (pipeline schedules, micro-batches)
and their backwards may run in any order. One module's calls must stay on one stream (or streams
synchronised with each other): its backward workspaces are shared by all micro-batches.
`recompute=True` (GroupedMLP) keeps only x and the routing and recomputes the rest in backward;
torch.utils.checkpoint works around either module. A copy (copy.deepcopy, or torch.save / torch.load
of the whole module) makes a library object of its own.

`fuse_fc1`: fc1, its bias and the activation x prob in one kernel (GroupedMLP: which also gathers
the rows of x, with no separate permute); same results within bf16 rounding, same saved state.
GroupedMLP's default (None) picks it where it was measured no slower on the H100: ffn_hidden_size <=
2048 (and at most 4096 experts, the kernel's limit); GroupedExperts fuses only when asked.
`save_x_perm=False` (GroupedMLP, with the fused fc1): no permuted copy of x is kept for backward --
the fc1 weight gradient gathers the rows of x itself, so a micro-batch in flight holds
rows x hidden_size x 2 bytes less; x is then saved for backward (as autograd does for any input).
GroupedMLP's default (None) picks it with the fused fc1 for ffn_hidden_size <= 2048 (outside
recompute mode): with the fused fc2 dgrad that then follows, the layer is as fast as with x_perm up
to 1024 and within 1-2% at 2048 (its forward writes no x_perm), in less memory.
`fuse_fc2_dgrad`: in backward, fc2's data gradient, the activation backward and the probs' gradient in
one kernel (GroupedMLP: which also gathers the rows of dy, with no separate pass building them); the
same dh as the unfused path within bf16 rounding, and a saved state without the activation (it is
recomputed from the pre-activation). GroupedMLP's default (None) picks it where it costs no time:
ffn_hidden_size <= 256, or without x_perm, bias, delay_wgrad and probs_at_combine (the fc2 weight
gradient then gathers dy too); GroupedExperts fuses only when asked.

`token_chunks=n` (GroupedMLP): fc2 + combine and the fc1 dgrad + the sum of each token's rows in n
pieces of consecutive tokens, so the layer's workspace holds one piece of the experts' [rows, H]
output instead of all of it (docs/state.md, token chunks): bitwise the same results, for n launches
of fc2 and of the fc1 dgrad. Needs the fused fc2 dgrad without x_perm (the default up to
ffn_hidden_size 2048), no bias, probs in the activation, bf16.

`fp8="block"` (GroupedMLP): the experts' six GEMMs run in FP8 E4M3 with block scaling (1x128 blocks
for tokens and gradients, 128x128 for weights, fp32 scales; TransformerEngine's Float8BlockScaling
recipe); `fp8="block_pow2"` the same with every scale rounded down to a power of two, as
Float8BlockScaling computes them by default (NVTE_FP8_BLOCK_SCALING_FP32_SCALES unset);
parameters, inputs, outputs and gradients stay bf16 / fp32 (docs/layer.md, FP8 experts).
It runs the unfused path (fuse_fc1 and fuse_fc2_dgrad default to False) and needs align=128 (the
default with fp8). `fp8_weight_refresh="every_forward"` quantizes the weights in every forward;
"on_request" only in `refresh_fp8_weights()`, to be called after every change of the weights
(once per optimizer step, before the first micro-batch). "from_master" (FP8 primary weights): the
weight parameters are fp32 (the master weights the optimizer updates; biases stay bf16),
`refresh_fp8_weights()` quantizes them straight from fp32, and the FP8 copies are the only weights
computed with -- no bf16 weight exists; needs accumulate_into_main_grad=True. `fp8_weights()` gives
a snapshot of the quantized copies and `load_fp8_weights(tensors)` writes loaded ones into them
(checkpoint keys, docs/checkpoints.md).

`fp8="mxfp8"` or `fp8="nvfp4"`: the Blackwell formats, **emulated** on Hopper (docs/layer.md,
emulated MXFP8 / NVFP4). Every GEMM operand is quantized exactly into the codes and scales a
Blackwell GEMM reads (MXFP8: 1x32 blocks, E8M0 scales; NVFP4: 1x16 token blocks and 16x16 weight
blocks, E4M3 scales, a global amax per expert; round to nearest, no stochastic rounding or Hadamard
transform) and its dequantized values feed the bf16 GEMMs, so the numerics are the recipe's while
the speed is not. The unfused path; align defaults to 32 (mxfp8) or 16 (nvfp4), which
gives every expert whole blocks. fp8_weight_refresh as for "block" ("from_master": the fp32 master
weights quantized straight into the format)."""
import weakref

import torch
from torch import nn

from ._handles import HandleOwner
from .state_dict import normalize_expert_keys

_ops = torch.ops.moe_engine
# The tensors of one quantized weight in moe-engine's checkpoints (docs/checkpoints.md), in the order
# the library lists them: rowwise data, its scales, columnwise data, its scales, NVFP4's global amax.
_QUANT_PART_SUFFIXES = ("", "_scale_inv", "_columnwise", "_columnwise_scale_inv", "_amax")
_GATED = {"swiglu", "geglu", "clamped-swiglu"}
_ORDER = (("fc2", "weight"), ("fc2", "bias"), ("fc1", "weight"), ("fc1", "bias"))


def _fused_default(choice, ffn_hidden_size, num_experts, max_ffn):
    # A fused kernel where it was measured no slower (ffn_hidden_size <= max_ffn, and at most 4096
    # experts, the kernels' limit), unless chosen; mirrors `moe-engine bench --fc1 auto`.
    return (ffn_hidden_size <= max_ffn and num_experts <= 4096) if choice is None else bool(choice)


def _bf16_autocast():
    return torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16


def _activation_input(x):
    """x as the op takes it, bf16: under a bf16 torch.autocast an fp32 or fp16 x (a norm's output, say)
    is cast, differentiably, as autocast casts a linear's input; otherwise x goes to the op as it is,
    which refuses a dtype other than bf16 by name."""
    if x.dtype in (torch.float32, torch.float16) and _bf16_autocast():
        return x.to(torch.bfloat16)
    return x


def _probs_input(probs):
    """Routing probabilities in fp32: bf16 or fp16 ones (a router's output) are widened, exactly and
    differentiably (their gradient comes back in their dtype)."""
    if probs is not None and probs.dtype in (torch.bfloat16, torch.float16):
        return probs.float()
    return probs


def _weight_addresses(ctx, params):
    """At a forward: the addresses of the parameters its backward reads again (the op binds weights by
    address), as a CPU tensor for save_for_backward -- so that a recompute under non-reentrant
    activation checkpointing saves the addresses it bound -- or None where there is nothing to watch
    (no gradient needed, or torch.compile tracing: fake tensors have no addresses)."""
    if torch.compiler.is_compiling() or not any(ctx.needs_input_grad):
        return None
    ctx.weight_params = params
    return torch.tensor([q.data_ptr() for q in params], dtype=torch.int64)


def rebind_moved_weights(ctx, addresses, rebind):
    """At a backward (after unpacking the saved tensors): where parameters moved since the forward bound
    them -- FSDP resharding after the forward and gathering them again for the backward, ZeRO-3 --
    calls rebind() to bind them at their new addresses within the same binding (the op's
    rebind_weights: the values are the forward's), instead of letting the backward read memory since
    freed. Eager mode only (see _weight_addresses)."""
    if addresses is not None and any(q.data_ptr() != a for q, a in zip(ctx.weight_params, addresses.tolist())):
        rebind()


def _normalize_keys_hook(module, *args, **kwargs):
    # load_state_dict's pre-hook, registered with_module (a plain function: copied and pickled)
    module._normalize_keys(*args, **kwargs)


def _fuse_fc1(choice, ffn_hidden_size, num_experts):
    return _fused_default(choice, ffn_hidden_size, num_experts, 2048)


def _save_x_perm(choice, fuse_fc1, ffn_hidden_size, recompute):
    # No x_perm with the fused fc1 up to ffn_hidden_size 2048, unless chosen: with the fused fc2
    # dgrad that then follows, as fast as keeping it up to 1024 and within 1-2% at 2048, in less
    # memory; mirrors `moe-engine bench --x-perm auto`. Recompute mode saves no x_perm either way (its
    # backward permutes x again), so there the default stays: the fc1 weight gradient reads the
    # x_perm that backward rebuilds.
    if choice is not None:
        return bool(choice)
    return not (fuse_fc1 and ffn_hidden_size <= 2048 and not recompute)


def _fuse_fc2_dgrad(choice, ffn_hidden_size, num_experts, save_x_perm, keeps_dY):
    # The fused fc2 dgrad where it was measured to cost no time: ffn_hidden_size <= 256, or without
    # x_perm when the fc2 weight gradient then gathers dy too (no bias, no delayed weight gradient, probs
    # in the activation: otherwise dY_perm is built); mirrors `moe-engine bench --dgrad auto`.
    if choice is not None:
        return bool(choice)
    return num_experts <= 4096 and (ffn_hidden_size <= 256 or not (save_x_perm or keeps_dY))


# Per-expert row alignment that gives each recipe's expert rows whole blocks.
_FP8_ALIGN = {"block": 128, "block_pow2": 128, "mxfp8": 32, "nvfp4": 16}
# The FP8 block-scaled recipes (Hopper tensor cores), as against the emulated Blackwell formats.
_FP8_BLOCK_RECIPES = ("block", "block_pow2")


def _check_fp8_options(fp8, fp8_weight_refresh, accumulate_into_main_grad):
    if fp8 is not None and fp8 not in _FP8_ALIGN:
        raise ValueError(f"argument 'fp8': expected None, 'block', 'block_pow2', 'mxfp8' or 'nvfp4', got {fp8!r}")
    if fp8_weight_refresh not in ("every_forward", "on_request", "from_master"):
        raise ValueError("argument 'fp8_weight_refresh': expected 'every_forward', 'on_request' or 'from_master', "
                         f"got {fp8_weight_refresh!r}")
    if fp8_weight_refresh == "from_master" and (fp8 is None or not accumulate_into_main_grad):
        raise ValueError("argument 'fp8_weight_refresh': 'from_master' (quantized primary weights: fp32 weight "
                         "parameters) needs fp8 ('block', 'block_pow2', 'mxfp8' or 'nvfp4') and "
                         "accumulate_into_main_grad=True (the gradients go to each parameter's fp32 main_grad)")


class _ExpertModule(HandleOwner, nn.Module):
    """Parameters, gradient buffers and wgrad hooks shared by GroupedMLP and GroupedExperts."""

    # The submodule names that hold fc1's and fc2's parameters (and so the state-dict keys and the
    # names the wgrad hooks get). A subclass may rename them, e.g. Megatron's linear_fc1/linear_fc2,
    # and give them a class of its own (_OWNER_CLASS: an nn.Module constructed without arguments).
    _OWNER_NAMES = {"fc1": "fc1", "fc2": "fc2"}
    _OWNER_CLASS = nn.Module
    _HANDLE = "_handle"

    def _setup_params(self, hidden_size, ffn_hidden_size, num_experts, activation, bias, per_expert_weights,
                      accumulate_into_main_grad, wgrad_dtype, delay_wgrad, device, init_std,
                      weight_dtype=torch.bfloat16):
        if wgrad_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"argument 'wgrad_dtype': expected torch.bfloat16 or torch.float32, got {wgrad_dtype}")
        if wgrad_dtype == torch.float32 and not accumulate_into_main_grad:
            raise ValueError("argument 'wgrad_dtype': fp32 weight gradients go to an fp32 main_grad "
                             "(accumulate_into_main_grad=True); param.grad must match the bf16 parameters")
        self.hidden_size, self.ffn_hidden_size, self.num_experts = hidden_size, ffn_hidden_size, num_experts
        self.per_expert_weights = per_expert_weights
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.wgrad_dtype = wgrad_dtype
        self.delay_wgrad = delay_wgrad
        self.has_bias = bias
        fc1_out = 2 * ffn_hidden_size if activation in _GATED else ffn_hidden_size
        self._shapes = {("fc1", "weight"): (fc1_out, hidden_size), ("fc1", "bias"): (fc1_out,),
                        ("fc2", "weight"): (hidden_size, ffn_hidden_size), ("fc2", "bias"): (hidden_size,)}
        device = torch.device("cuda") if device is None else torch.device(device)
        for p in ("fc1", "fc2"):
            setattr(self, self._OWNER_NAMES[p], self._OWNER_CLASS())
        for (p, s), shape in self._shapes.items():
            if s == "bias" and not bias:
                continue
            std = init_std if init_std is not None else (shape[-1] ** -0.5 if s == "weight" else 0.0)
            dtype = weight_dtype if s == "weight" else torch.bfloat16
            owner = getattr(self, self._OWNER_NAMES[p])
            if per_expert_weights:
                for e in range(num_experts):
                    owner.register_parameter(f"{s}{e}", nn.Parameter(self._init(shape, std, device, dtype)))
            else:
                owner.register_parameter(s, nn.Parameter(self._init((num_experts, *shape), std, device, dtype)))
        self._hooks = []
        self._pending_dw = []  # delayed mode: (state tensors, gradient buffers) of each backward, oldest first
        # with_module: PyTorch holds the module weakly (a bound method would make a reference cycle)
        # and copies and pickles the hook with it.
        self._register_load_state_dict_pre_hook(_normalize_keys_hook, with_module=True)
        self._register_grad_hooks()

    def _register_grad_hooks(self):
        """Write mode: a gradient is final once autograd has accumulated it into param.grad. The hooks
        hold the module weakly: module -> parameter -> hook -> module would be a reference cycle, which
        leaves the module -- and the library object behind its handle -- to the garbage collector
        instead of freeing it when its last user drops it."""
        if self.accumulate_into_main_grad or self.delay_wgrad:
            return
        module = weakref.ref(self)

        def fire(name, q):
            target = module()
            if target is not None:
                target._fire_hook(name, q)
        for name, q in self.named_parameters():
            q.register_post_accumulate_grad_hook(lambda q, name=name: fire(name, q))

    # -- copies (copy.deepcopy, pickle) ------------------------------------------------------
    def __getstate__(self):
        state = super().__getstate__()
        state["_pending_dw"] = []  # the backwards in flight stay with the original
        return state

    def __setstate__(self, state):
        super().__setstate__(state)  # a library object of its own (HandleOwner)
        self._register_grad_hooks()  # parameter hooks are neither copied nor pickled by PyTorch

    def _handle_device(self):
        q = next(self.parameters(), None)
        return q.device if q is not None and q.is_cuda else None

    @staticmethod
    def _init(shape, std, device, dtype=torch.bfloat16):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.normal_(0.0, std) if std > 0 else t.zero_()

    # -- parameters --------------------------------------------------------------------------
    def expert_params(self, p, s):
        """The parameter(s) of fc1/fc2 weight/bias: [grouped] or [expert 0, .., expert E-1]."""
        if s == "bias" and not self.has_bias:
            return []
        owner = getattr(self, self._OWNER_NAMES[p])
        if self.per_expert_weights:
            return [getattr(owner, f"{s}{e}") for e in range(self.num_experts)]
        return [getattr(owner, s)]

    def _param_lists(self):
        return [self.expert_params(p, s) for p, s in (("fc1", "weight"), ("fc1", "bias"), ("fc2", "weight"),
                                                      ("fc2", "bias"))]

    def _flat_params(self):
        return [q for lst in self._param_lists() for q in lst]

    def _reads_weights_in_backward(self):
        # The quantized experts' backward reads their quantized copies, not these parameters (unless it
        # recomputes the forward).
        return self.fp8 is None or getattr(self, "recompute", False)

    # -- quantized weight copies (fp8) ----------------------------------------------------------
    def _op(self, name):
        return getattr(_ops, f"{self._OP_PREFIX}_{name}")

    def _fp8_weight_views(self, method):
        """{key: view} of the copies' parts the format stores. The views are over the library object's
        own memory and do not keep it alive: used within the calling method only."""
        if self.fp8 is None:
            raise ValueError(f"{method}: the layer does not quantize its weights (fp8=None)")
        parts, views = self._op("fp8_weight_views")(self._handle)
        # The checkpoints' names (docs/checkpoints.md), whatever the subclass calls its submodules.
        names = [f"{p}.weight{suffix}" for p in ("fc1", "fc2") for suffix in _QUANT_PART_SUFFIXES]
        return {names[i]: v for i, v in zip(parts, views)}

    def fp8_weights(self):
        """fp8: the quantized weight copies the GEMMs compute with, as tensors of their own (a snapshot,
        e.g. to save beside or instead of the bf16 weights), keyed as moe-engine's checkpoints store
        them (docs/checkpoints.md): "fc1.weight" (rowwise data, [E, fc1_out, H]), "fc1.weight_scale_inv",
        "fc1.weight_columnwise", "fc1.weight_columnwise_scale_inv", the same for fc2, and "..._amax"
        with nvfp4 (block: float8_e4m3fn data with float32 scales; mxfp8: float8_e8m0fnu scales;
        nvfp4: uint8 data, two values a byte, float8_e4m3fn scales). Refused unless copies were made
        for the parameters as they are bound now (refresh_fp8_weights(), load_fp8_weights(), or with
        fp8_weight_refresh="every_forward" a forward: the snapshot then holds the weights as of that
        forward, not changes made in place since)."""
        views = self._fp8_weight_views("fp8_weights")
        if not self._op("fp8_weights_current")(self._handle, *self._param_lists()):
            raise ValueError("fp8_weights: no quantized copies of the current weights yet; call "
                             "refresh_fp8_weights() (or run a forward with fp8_weight_refresh=\"every_forward\")")
        return {name: view.clone() for name, view in views.items()}

    def load_fp8_weights(self, tensors, prefix=""):
        """fp8 with fp8_weight_refresh="on_request" or "from_master": writes quantized weights -- a
        snapshot of fp8_weights(), or a checkpoint's tensors under the same keys after `prefix` -- into
        the copies the GEMMs compute with, which then count as refreshed: the forwards and backwards
        that follow use them bit for bit until the next refresh_fp8_weights(). Every key the format
        stores is required with its dtype and shape (KeyError / ValueError naming it; checked, and
        every part moved to the layer's device, before any byte is written); other keys are ignored.
        With fp8="block" or "block_pow2" a weight's columnwise copy (both its parts) may be left out:
        the 128x128 blocks of the transposed weight are the rowwise blocks transposed, so they are
        derived from the rowwise data and scales, bit for bit (a checkpoint that stores only `weight`
        / `weight_scale_inv`, as DeepSeek-V3's does, loads once gate and up are concatenated into fc1
        -- F a multiple of 128, so that their scale blocks do not straddle -- and the experts
        stacked). Neither a scale layout nor a GLU
        interleave can be told from dtypes and shapes: load what was written for this layer's
        configuration (fp8_weights(), moe-engine's checkpoints). The bf16 (or fp32 master) weights are
        left as they are: load them too if a later refresh_fp8_weights() is to start from the same
        values; moving the parameters (a new binding) discards the loaded copies."""
        views = self._fp8_weight_views("load_fp8_weights")
        if getattr(self, "fp8_weight_refresh", "every_forward") == "every_forward":
            raise ValueError("load_fp8_weights: with fp8_weight_refresh=\"every_forward\" each forward quantizes "
                             "the weights again; use \"on_request\" or \"from_master\"")
        tensors = self._with_columnwise_parts(tensors, prefix, views)
        missing = [prefix + name for name in views if prefix + name not in tensors]
        if missing:
            raise KeyError(f"load_fp8_weights: missing {missing}")
        for name, view in views.items():
            t = tensors[prefix + name]
            if not isinstance(t, torch.Tensor) or t.dtype != view.dtype or t.shape != view.shape:
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"argument 'tensors': '{prefix}{name}': expected {view.dtype} {list(view.shape)}, "
                                 f"got {got}")
        with torch.no_grad():
            # Every part on the device first, so that a tensor that cannot move fails before the
            # copies hold some new parts and some old (they would still count as current).
            staged = {name: tensors[prefix + name].to(view.device) for name, view in views.items()}
            for name, view in views.items():
                view.copy_(staged[name])
            self._op("accept_fp8_weights")(self._handle, *self._param_lists())

    def _with_columnwise_parts(self, tensors, prefix, views):
        """fp8="block" / "block_pow2": `tensors` with a weight's columnwise copy (data and scales)
        derived from its rowwise copy as their last two dimensions transposed (128x128 blocks quantize
        the same values either way) when both columnwise parts are absent and both rowwise parts
        present; other formats, or a copy given in part (then refused as missing), as they are."""
        if self.fp8 not in _FP8_BLOCK_RECIPES:
            return tensors
        derived = {}
        for p in ("fc1", "fc2"):
            parts = ("", "_scale_inv")
            cols = [f"{prefix}{p}.weight_columnwise{s}" for s in parts]
            rows = [f"{prefix}{p}.weight{s}" for s in parts]
            if (all(c[len(prefix):] in views and c not in tensors for c in cols)
                    and all(isinstance(tensors.get(r), torch.Tensor) for r in rows)):
                derived.update({c: tensors[r].transpose(-1, -2) for c, r in zip(cols, rows)})
        return {**tensors, **derived} if derived else tensors

    def _normalize_keys(self, state_dict, prefix, *args, **kwargs):
        normalize_expert_keys(state_dict, prefix, self.num_experts, self.per_expert_weights,
                              params=(self._OWNER_NAMES["fc1"], self._OWNER_NAMES["fc2"]))

    def register_wgrad_hook(self, fn):
        """fn(name, param) once per step for each parameter whose weight gradient is final."""
        self._hooks.append(fn)

    def _fire_hook(self, name, param):
        for fn in self._hooks:
            fn(name, param)

    def _fire_hooks(self):
        for p, s in _ORDER:
            for i, param in enumerate(self.expert_params(p, s)):
                name = f"{self._OWNER_NAMES[p]}.{s}"
                self._fire_hook(f"{name}{i}" if self.per_expert_weights else name, param)

    def _grad_buffers(self):
        """Where the op writes weight gradients: main_grad (accumulate) or new grouped buffers."""
        lists = []
        for p, s in (("fc1", "weight"), ("fc1", "bias"), ("fc2", "weight"), ("fc2", "bias")):
            params = self.expert_params(p, s)
            if not params:
                lists.append([])
            elif self.accumulate_into_main_grad:
                for q in params:
                    if getattr(q, "main_grad", None) is None:
                        raise ValueError(f"accumulate_into_main_grad: parameter {self._OWNER_NAMES[p]}.{s} has no fp32 "
                                         "'main_grad'")
                lists.append([q.main_grad for q in params])
            else:
                shape = (self.num_experts, *self._shapes[(p, s)])
                lists.append([torch.empty(shape, dtype=self.wgrad_dtype, device=params[0].device)])
        return lists

    def _as_param_grads(self, lists):
        """Per-parameter gradient tensors (views of grouped buffers for per-expert parameters)."""
        out = []
        for buf in lists:
            if not buf:
                continue
            out.extend(list(buf[0].unbind(0)) if self.per_expert_weights else buf)
        return out

    def _mark_main_grad(self):
        for q in self._flat_params():
            q.grad_added_to_main_grad = True

    # -- backward plumbing shared by both autograd functions ------------------------------------
    def _after_backward(self, run_backward, keep_for_dw, wants_param_grads=True):
        """Runs the op's backward with the right gradient buffers; returns the per-parameter grads
        for autograd (or Nones). Where no expert parameter wants a gradient (`wants_param_grads`
        false: frozen experts, e.g. adapters trained around them) the op gets no gradient buffers and
        computes only dx and the probs' gradient, with no weight gradient and no hook."""
        n = len(self._flat_params())
        if self.delay_wgrad:
            outs = run_backward([[], [], [], []])
            # Frozen experts owe no weight gradient: backward_dw() has nothing to do for this backward.
            self._pending_dw.append(keep_for_dw if wants_param_grads else None)
            return outs, [None] * n
        if not wants_param_grads:
            return run_backward([[], [], [], []]), [None] * n
        lists = self._grad_buffers()
        outs = run_backward(lists)
        if self.accumulate_into_main_grad:
            self._mark_main_grad()
            self._fire_hooks()
            return outs, [None] * n
        return outs, self._as_param_grads(lists)  # hooks fire after autograd accumulates them

    def backward_dw(self):
        """Delayed mode: the weight gradients of the oldest backward whose backward_dw has not run,
        fc2 then fc1, then the wgrad hooks. Gradients go to main_grad (accumulate) or are added to
        param.grad. Call it once per backward, in the order the backwards ran."""
        if not self.delay_wgrad:
            raise RuntimeError("backward_dw: only for delay_wgrad=True")
        if not self._pending_dw:
            raise RuntimeError("backward_dw: no pending weight gradients (run backward first)")
        pending = self._pending_dw.pop(0)
        if pending is None:  # a backward with frozen experts
            return
        lists = self._grad_buffers()
        self._run_backward_dw(pending, lists)
        if not self.accumulate_into_main_grad:
            for q, g in zip(self._flat_params(), self._as_param_grads(lists)):
                q.grad = g if q.grad is None else q.grad + g
        else:
            self._mark_main_grad()
        self._fire_hooks()


class GroupedMLP(_ExpertModule):
    _OP_PREFIX = "mlp"
    _DESTROY = "mlp_destroy"

    def __init__(self, hidden_size, ffn_hidden_size, num_experts, topk, max_tokens, activation="swiglu",
                 glu_interleave=0, bias=False, probs_at_combine=False, align=0, pre_padded=False, row_bound=-1,
                 map_routing=False, per_expert_weights=False, accumulate_into_main_grad=False,
                 wgrad_dtype=torch.bfloat16, delay_wgrad=False, recompute=False, clamp_alpha=1.702,
                 clamp_limit=7.0, clamp_offset=1.0, device=None, init_std=None, fuse_fc1=None, save_x_perm=None,
                 fuse_fc2_dgrad=None, fp8=None, fp8_weight_refresh="every_forward", token_chunks=1):
        super().__init__()
        _check_fp8_options(fp8, fp8_weight_refresh, accumulate_into_main_grad)
        self.fp8 = fp8
        self.fp8_weight_refresh = fp8_weight_refresh
        self.token_chunks = token_chunks
        if fp8 is not None:
            # The quantized experts run the unfused path on expert rows aligned to their blocks.
            fuse_fc1 = False if fuse_fc1 is None else fuse_fc1
            fuse_fc2_dgrad = False if fuse_fc2_dgrad is None else fuse_fc2_dgrad
            align = _FP8_ALIGN[fp8] if align == 0 else align
        self.topk = topk
        self.recompute = recompute
        self.fuse_fc1 = _fuse_fc1(fuse_fc1, ffn_hidden_size, num_experts)
        self.save_x_perm = _save_x_perm(save_x_perm, self.fuse_fc1, ffn_hidden_size, recompute)
        self.fuse_fc2_dgrad = _fuse_fc2_dgrad(fuse_fc2_dgrad, ffn_hidden_size, num_experts, self.save_x_perm,
                                              keeps_dY=bias or delay_wgrad or probs_at_combine)
        # Whether backward (and backward_dw) read the forward's x again.
        self.reads_x = recompute or not self.save_x_perm
        self.slots = num_experts if map_routing else topk
        self._make_handle("mlp_create", hidden_size, ffn_hidden_size, num_experts, topk, max_tokens,
                          activation, glu_interleave, clamp_alpha, clamp_limit, clamp_offset, bias,
                          probs_at_combine, align, pre_padded, row_bound, map_routing, per_expert_weights,
                          accumulate_into_main_grad, wgrad_dtype == torch.float32, delay_wgrad, recompute,
                          self.fuse_fc1, self.save_x_perm, self.fuse_fc2_dgrad, False, fp8 or "none",
                          fp8_weight_refresh, token_chunks)
        self._state_bytes = _ops.mlp_state_bytes(self._handle)
        self._setup_params(hidden_size, ffn_hidden_size, num_experts, activation, bias, per_expert_weights,
                           accumulate_into_main_grad, wgrad_dtype, delay_wgrad, device, init_std,
                           weight_dtype=torch.float32 if fp8_weight_refresh == "from_master" else torch.bfloat16)

    def forward(self, x, routing, probs):
        """x bf16 [T, H] (another float dtype under a bf16 autocast: cast); routing int32 [T, k] top-k
        indices (-1 = empty) or bool/uint8 [T, E] map; probs fp32 (bf16 / fp16 widened) like routing.
        Returns y bf16 [T, H]."""
        return _MlpFunction.apply(self, _activation_input(x), routing, _probs_input(probs), *self._flat_params())

    def _run_backward_dw(self, pending, lists):
        state, header, x = pending
        _ops.mlp_backward_dw(self._handle, state, header, None if self.recompute else x, *lists)

    def refresh_fp8_weights(self):
        """fp8 with fp8_weight_refresh="on_request" or "from_master": quantizes the current weights
        (from_master: the fp32 weight parameters, straight from fp32) for the forwards and backwards
        that follow. Call it after every change of the weights (an optimizer step)."""
        with torch.no_grad():
            _ops.mlp_refresh_fp8_weights(self._handle, *self._param_lists())

    def check_errors(self):
        """Raises ValueError if routing entries were skipped (bad expert id, duplicate expert,
        non-finite prob) or rows overflowed R, or (fp8) an expert's rows were off the 128-row grid.
        Synchronises: call outside CUDA graphs."""
        _ops.mlp_check_errors(self._handle)

    def workspace_bytes(self):
        """Device bytes the layer holds (workspaces shared by all micro-batches)."""
        return _ops.mlp_workspace_bytes(self._handle)

    def state_bytes(self):
        """Device bytes one micro-batch in flight keeps until its backward."""
        return self._state_bytes


class GroupedExperts(_ExpertModule):
    """The experts alone: forward(x_perm [rows, H], group_offsets int32 [E + 1], probs_perm fp32
    [rows] or None) -> Y [rows, H], rows <= max_rows, group e = rows [g[e], g[e+1]) (e.g. the
    outputs of moe_engine.Dispatcher.permute, or of an expert-parallel all-to-all). With
    probs_at_combine=True the experts do not scale by probs (pass None). Differentiable in x_perm,
    probs_perm and the parameters.

    fp8="block" / "block_pow2" and fp8_weight_refresh as for GroupedMLP; the rows of each expert must
    then fill whole 128-row blocks (start on a multiple of 128, e.g. a dispatcher with align=128) and max_rows
    be a multiple of 16. An expert off that grid is reported by check_errors() (its weight gradient
    is skipped). fp8="mxfp8" / "nvfp4" (emulated) take any groups: each expert's rows are quantized
    as a matrix of their own (whole blocks when they start on multiples of 32 / 16)."""

    _OP_PREFIX = "experts"
    _DESTROY = "experts_destroy"

    def __init__(self, hidden_size, ffn_hidden_size, num_experts, max_rows, activation="swiglu",
                 glu_interleave=0, bias=False, probs_at_combine=False, per_expert_weights=False,
                 accumulate_into_main_grad=False, wgrad_dtype=torch.bfloat16, delay_wgrad=False,
                 clamp_alpha=1.702, clamp_limit=7.0, clamp_offset=1.0, device=None, init_std=None,
                 fuse_fc1=None, fuse_fc2_dgrad=None, fp8=None, fp8_weight_refresh="every_forward"):
        super().__init__()
        _check_fp8_options(fp8, fp8_weight_refresh, accumulate_into_main_grad)
        self.fp8 = fp8
        self.fp8_weight_refresh = fp8_weight_refresh
        self.probs_at_combine = probs_at_combine
        self._make_handle("experts_create", hidden_size, ffn_hidden_size, num_experts, max_rows, activation,
                          glu_interleave, clamp_alpha, clamp_limit, clamp_offset, bias, probs_at_combine,
                          per_expert_weights, accumulate_into_main_grad, wgrad_dtype == torch.float32,
                          delay_wgrad, bool(fuse_fc1), bool(fuse_fc2_dgrad), fp8 or "none", fp8_weight_refresh)
        self._state_bytes = _ops.experts_state_bytes(self._handle)
        self._setup_params(hidden_size, ffn_hidden_size, num_experts, activation, bias, per_expert_weights,
                           accumulate_into_main_grad, wgrad_dtype, delay_wgrad, device, init_std,
                           weight_dtype=torch.float32 if fp8_weight_refresh == "from_master" else torch.bfloat16)

    def forward(self, x_perm, group_offsets, probs_perm=None):
        if self.probs_at_combine and probs_perm is not None:
            raise ValueError("argument 'probs_perm': the experts were built with probs_at_combine=True; pass None")
        if not self.probs_at_combine and probs_perm is None:
            raise ValueError("argument 'probs_perm': expected float [rows] probs (probs_at_combine=False)")
        return _ExpertsFunction.apply(self, _activation_input(x_perm), group_offsets, _probs_input(probs_perm),
                                      *self._flat_params())

    def _run_backward_dw(self, pending, lists):
        state, header, x_perm, group_offsets, probs_perm, dY = pending
        _ops.experts_backward_dw(self._handle, state, header, x_perm, group_offsets, probs_perm, dY, *lists)

    def refresh_fp8_weights(self):
        """fp8 with fp8_weight_refresh="on_request" or "from_master": see GroupedMLP.refresh_fp8_weights."""
        with torch.no_grad():
            _ops.experts_refresh_fp8_weights(self._handle, *self._param_lists())

    def check_errors(self):
        """Raises ValueError if (fp8) an expert's rows were off the 128-row grid since the last check.
        Synchronises: call outside CUDA graphs."""
        _ops.experts_check_errors(self._handle)

    def state_bytes(self):
        return self._state_bytes


class _MlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mod, x, routing, probs, *params):
        x = x.contiguous()
        y, state, header = _ops.mlp_forward(mod._handle, x, routing.contiguous(), probs.contiguous(),
                                            *mod._param_lists(), mod._state_bytes)
        ctx.mod = mod
        addresses = _weight_addresses(ctx, params) if mod._reads_weights_in_backward() else None
        # x is read again in recompute mode and with save_x_perm=False (the fc1 weight gradient
        # gathers the rows of x): saved (and version-checked by autograd) only then.
        ctx.save_for_backward(x if mod.reads_x else None, state, header, addresses)
        return y

    @staticmethod
    def backward(ctx, dy):
        mod = ctx.mod
        x, state, header, addresses = ctx.saved_tensors
        rebind_moved_weights(ctx, addresses, lambda: _ops.mlp_rebind_weights(mod._handle, *mod._param_lists()))
        dy = dy.contiguous()
        (dx, dprobs), param_grads = mod._after_backward(
            lambda lists: _ops.mlp_backward(mod._handle, state, header, x, dy, mod.slots, *lists), (state, header, x),
            wants_param_grads=any(ctx.needs_input_grad[4:]))
        return (None, dx, None, dprobs, *param_grads)


class _ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mod, x_perm, group_offsets, probs_perm, *params):
        x_perm = x_perm.contiguous()
        group_offsets = group_offsets.contiguous()
        probs_perm = None if probs_perm is None else probs_perm.contiguous()
        Y, state, header = _ops.experts_forward(mod._handle, x_perm, group_offsets, probs_perm,
                                                *mod._param_lists(), mod._state_bytes)
        ctx.mod = mod
        ctx.has_probs = probs_perm is not None
        addresses = _weight_addresses(ctx, params) if mod._reads_weights_in_backward() else None
        # The op reads x_perm, group_offsets and probs_perm again by address in backward.
        ctx.save_for_backward(x_perm, group_offsets, probs_perm if ctx.has_probs else None, state, header, addresses)
        return Y

    @staticmethod
    def backward(ctx, dY):
        mod = ctx.mod
        x_perm, group_offsets, probs_perm, state, header, addresses = ctx.saved_tensors
        rebind_moved_weights(ctx, addresses, lambda: _ops.experts_rebind_weights(mod._handle, *mod._param_lists()))
        dY = dY.contiguous()
        # Delayed mode reads dY (and the saved inputs) again in backward_dw: keep them with the state --
        # except what the FP8 block-scaled backward_dw never reads, kept as empty placeholders (freed
        # with this backward): x_perm, whose FP8 copy the state holds, and without bias dY, whose
        # FP8 copies the backward writes into the state.
        kept_x_perm, kept_dY = x_perm, dY
        if mod.fp8 in _FP8_BLOCK_RECIPES:
            kept_x_perm = x_perm.new_empty(0)
            if not mod.has_bias:
                kept_dY = dY.new_empty(0)
        (dx_perm, dpp), param_grads = mod._after_backward(
            lambda lists: _ops.experts_backward(mod._handle, state, header, x_perm, group_offsets, probs_perm, dY,
                                                ctx.has_probs, *lists),
            (state, header, kept_x_perm, group_offsets, probs_perm, kept_dY),
            wants_param_grads=any(ctx.needs_input_grad[4:]))
        return (None, dx_perm, None, dpp if ctx.has_probs else None, *param_grads)
