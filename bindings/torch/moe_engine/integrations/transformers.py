"""Hugging Face transformers (5.x) experts implementations "moe_engine" and "moe_engine_fp8".

    import moe_engine.integrations.transformers          # registers both names on import
    model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16, experts_implementation="moe_engine")
    model.set_experts_implementation("moe_engine")       # or switch an existing model

"moe_engine_fp8" runs the experts' six GEMMs in FP8 E4M3 with block scaling (1x128 blocks for
tokens and gradients, 128x128 for weights: GroupedMLP(fp8="block"), docs/layer.md), the weights
quantized from the module's parameters in every forward, so they may change between steps as they
like; parameters, inputs, outputs and gradients stay as with "moe_engine". It needs the standard
weight orientation (not GPT-OSS's transposed experts) and hidden and intermediate sizes that are
multiples of 16.

How transformers dispatches (read in transformers 5.17, src/transformers/integrations/moe.py): the
experts classes of the MoE models are decorated with `@use_experts_implementation(is_concatenated=,
is_transposed=, has_bias=, has_gate=)`, which stores those four flags as attributes of every
instance and makes `forward` look up `config._experts_implementation` in
`ALL_EXPERTS_FUNCTIONS` (an `ExpertsInterface`, a `GeneralInterface`), calling
`fn(experts_module, hidden_states, top_k_index, top_k_weights)`. `ExpertsInterface.register(name,
fn)` adds to the class-wide mapping that every instance reads; the model-level check
(`PreTrainedModel.get_correct_experts_implementation`) accepts any name in
`ALL_EXPERTS_FUNCTIONS.keys()`, so a registered name is valid for `from_pretrained` and
`set_experts_implementation`.

What the function reads from the experts module (the attributes the 5.17 experts classes define):
  - `gate_up_proj` [E, 2F, H] (gated, `has_gate`) or `up_proj` [E, F, H] (not gated, NemotronH);
    `down_proj` [E, H, F]; `gate_up_proj_bias` / `up_proj_bias` [E, 2F] and `down_proj_bias` [E, H]
    when `has_bias`. Transposed modules (`is_transposed`, GPT-OSS: gate_up_proj [E, H, 2F],
    down_proj [E, F, H], gradients in the same shapes) are read in that orientation, in place too
    (GroupedMlpConfig::transposed_weights: the grouped GEMMs take either major order; the fused fc1
    is not used for them).
  - the GLU layout from `is_concatenated`: True -> gate rows then up rows (glu_interleave 0), False
    -> alternating rows (glu_interleave 1, GPT-OSS).
  - the activation from the class's `_apply_gate`: the default gate of moe.py
    (`act_fn(gate) * up` on the two halves) with `act_fn` SiLU -> swiglu, tanh-approximated GELU ->
    geglu; GPT-OSS's own `_apply_gate` (clamp, `alpha`, `limit`, `up + 1`) -> clamped-swiglu with
    the module's `alpha` and `limit` and offset 1; the clamped gates of DeepSeek-V4, GLM-5-Next and
    Hunyuan v4 (silu(min(gate, L)) * clamp(up, -L, L)) -> clamped-swiglu with alpha 1, offset 0 and the
    module's limit, and MiniMax-M3's (GPT-OSS's on the halves) with its swiglu_alpha / swiglu_limit.
    Not gated: `act_fn` ReLUSquared -> squared-relu.
    Any other gate or activation is refused with the attribute named.

Call contract: hidden_states [T, H] (cast to bf16 when it is not), top_k_index [T, k] integer,
top_k_weights [T, k] (or a router's dense [T, E], gathered at each slot's expert) any float dtype ->
[T, H] in hidden_states' dtype. Expert ids outside [0, E) are expert-parallel sentinels: they become
-1 (an empty slot) and contribute nothing, and their weight gets a zero gradient. Differentiable in
hidden_states, top_k_weights and the four expert parameters; weight gradients are returned to
autograd in the parameters' dtype. bf16 parameters are read in place; fp32 / fp16 ones only under
torch.autocast with bf16, cast for each forward into bf16 copies the layer object keeps (as autocast
casts an nn.Linear's weight).

Layers: one moe_engine layer object (configuration and workspaces, no parameters) per experts
module, made on its first call, sized for `max_tokens` tokens. A call with more tokens makes a
larger one (the next power of two, at least 256): that allocates workspaces, so it must not happen
during CUDA graph capture -- call `reserve(experts_module, max_tokens, topk)` before capturing. A
forward still waiting for its backward keeps the layer object it ran on alive."""
import weakref

import torch

from .._handles import release
from ..module import _bf16_autocast, _fuse_fc1, _weight_addresses, rebind_moved_weights

_ops = torch.ops.moe_engine

NAME = "moe_engine"
NAME_FP8 = "moe_engine_fp8"
_MIN_TOKENS = 256


# ---------------------------------------------------------------------------------------------
# What the experts module is: weights, layout, activation


class _Spec:
    """The static description of one experts module, derived from its attributes."""

    __slots__ = ("w1_name", "b1_name", "w1", "b1", "w2", "b2", "hidden", "ffn", "experts", "activation",
                 "interleave", "alpha", "limit", "offset", "transposed")

    def tensors(self):
        return (self.w1, self.w2, self.b1, self.b2)

    def key(self, topk):
        dtypes = tuple(None if t is None else t.dtype for t in self.tensors())
        return (self.hidden, self.ffn, self.experts, topk, self.activation, self.interleave, self.alpha,
                self.limit, self.offset, self.b1 is not None, self.transposed, dtypes)


def _module_flag(mod, name, default):
    # Set on every instance by @use_experts_implementation (transformers 5.x integrations/moe.py).
    return bool(getattr(mod, name, default))


def _class_name(mod):
    return type(mod).__name__


def _gate_function(mod):
    """The `_apply_gate` the class resolves (a plain function), or None."""
    for klass in type(mod).__mro__:
        if "_apply_gate" in vars(klass):
            return vars(klass)["_apply_gate"]
    return None


def _gpt_oss_gate():
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:  # a transformers without GPT-OSS
        return None
    return vars(GptOssExperts).get("_apply_gate")


# Experts classes whose `_apply_gate` is a clamped SwiGLU of the op's form, a * sigmoid(alpha a) *
# (clamp(up, -L, L) + offset) with a = min(gate, L), on the gate and up halves:
# (module, class, alpha or the attribute holding it, attribute holding L, offset, act_fn must be SiLU).
_CLAMPED_GATES = (
    ("deepseek_v4", "DeepseekV4Experts", 1.0, "limit", 0.0, True),         # self.act_fn(gate) * up
    ("glm5_next", "Glm5NextTextExperts", 1.0, "swiglu_limit", 0.0, False),  # F.silu(gate) * up
    ("hy_v4", "HYV4Experts", 1.0, "swiglu_limit", 0.0, False),              # F.silu(gate) * up
    ("minimax_m3_vl", "MiniMaxM3VLExperts", "swiglu_alpha", "swiglu_limit", 1.0, False),  # GPT-OSS's, on halves
    ("openai_privacy_filter", "OpenAIPrivacyFilterExperts", "alpha", "limit", 1.0, False),  # the same
)


def _clamped_gate(gate):
    """The _CLAMPED_GATES entry whose class defines `gate`, or None."""
    import importlib
    for module, cls, alpha, limit, offset, silu_act in _CLAMPED_GATES:
        try:
            klass = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
        except (ImportError, AttributeError):  # a transformers without that model
            continue
        if vars(klass).get("_apply_gate") is gate:
            return alpha, limit, offset, silu_act
    return None


def _default_gate():
    from transformers.integrations import moe as hf_moe
    return getattr(hf_moe, "_default_apply_gate", None)


def _act_kind(act):
    """swiglu / geglu / squared-relu for the activation modules transformers' ACT2FN makes."""
    from transformers import activations as A
    if isinstance(act, (torch.nn.SiLU, getattr(A, "SiLUActivation", torch.nn.SiLU))):
        return "silu"
    tanh_gelus = tuple(getattr(A, n) for n in ("GELUTanh", "NewGELUActivation", "FastGELUActivation") if hasattr(A, n))
    if tanh_gelus and isinstance(act, tanh_gelus):
        return "gelu_tanh"
    if isinstance(act, torch.nn.GELU) and getattr(act, "approximate", "none") == "tanh":
        return "gelu_tanh"
    if hasattr(A, "ReLUSquaredActivation") and isinstance(act, A.ReLUSquaredActivation):
        return "relu2"
    return None


def _activation(mod, spec, has_gate):
    cls = _class_name(mod)
    spec.alpha, spec.limit, spec.offset = 1.702, 7.0, 1.0  # the op's defaults; used by clamped-swiglu only
    if not has_gate:
        kind = _act_kind(getattr(mod, "act_fn", None))
        if kind != "relu2":
            raise NotImplementedError(
                f"moe_engine: {cls}.act_fn is {type(getattr(mod, 'act_fn', None)).__name__}; experts without a gate "
                "(has_gate=False) are supported with ReLU squared ('relu2', squared-relu) only")
        spec.activation = "squared-relu"
        return
    gate = _gate_function(mod)
    if gate is not None and gate is _gpt_oss_gate():
        # GPT-OSS: gate.clamp(max=limit), up.clamp(-limit, limit), (up + 1) * gate * sigmoid(alpha * gate).
        spec.activation = "clamped-swiglu"
        spec.alpha, spec.limit, spec.offset = float(mod.alpha), float(mod.limit), 1.0
        return
    clamped = _clamped_gate(gate) if gate is not None else None
    if clamped is not None:
        # DeepSeek-V4, GLM-5-Next, Hunyuan v4: silu(min(gate, L)) * clamp(up, -L, L); MiniMax-M3 and OpenAI's
        # privacy filter: GPT-OSS's gate on the halves. L (and the alpha of the latter two) come from the
        # module, as its own gate reads them.
        alpha, limit, offset, silu_act = clamped
        if silu_act and _act_kind(getattr(mod, "act_fn", None)) != "silu":
            raise NotImplementedError(
                f"moe_engine: {cls}.act_fn is {type(getattr(mod, 'act_fn', None)).__name__}; its clamped gate is "
                "supported with SiLU")
        spec.activation = "clamped-swiglu"
        spec.alpha = float(getattr(mod, alpha) if isinstance(alpha, str) else alpha)
        spec.limit, spec.offset = float(getattr(mod, limit)), offset
        return
    if gate is not None and gate is not _default_gate():
        raise NotImplementedError(
            f"moe_engine: {cls}._apply_gate is a custom gate ({gate.__qualname__}) that moe_engine does not "
            "implement; supported: the default act_fn(gate) * up with SiLU or tanh GELU, GPT-OSS's clamped SwiGLU, "
            "and the clamped gates of DeepSeek-V4, GLM-5-Next, Hunyuan v4, MiniMax-M3 and OpenAI's privacy filter")
    kind = _act_kind(getattr(mod, "act_fn", None))
    if kind == "silu":
        spec.activation = "swiglu"
    elif kind == "gelu_tanh":
        spec.activation = "geglu"
    else:
        raise NotImplementedError(
            f"moe_engine: {cls}.act_fn is {type(getattr(mod, 'act_fn', None)).__name__}; gated experts are supported "
            "with SiLU (swiglu) or the tanh-approximated GELU (geglu: gelu_pytorch_tanh, gelu_new, gelu_fast)")


# Weight dtypes a call can take: bf16 is read in place; fp32 and fp16 only under a bf16 autocast
# (`_check_autocast`).
_WEIGHT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _check_weight(mod, name, t, shape):
    cls = _class_name(mod)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"moe_engine: {cls}.{name} is missing")
    if t.dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"moe_engine: {cls}.{name} is {t.dtype}; moe_engine reads bf16 expert weights in place "
                         "(or fp32 / fp16 ones under torch.autocast with bf16)")
    if not t.is_cuda:
        raise ValueError(f"moe_engine: {cls}.{name} is on {t.device}; moe_engine runs on CUDA devices")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"moe_engine: {cls}.{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"moe_engine: {cls}.{name} is not contiguous (strides {t.stride()}); moe_engine reads "
                         "row-major expert weights in place and does not copy them")


def describe(mod):
    """The _Spec of an experts module (validated), or NotImplementedError / ValueError naming the
    attribute that moe_engine cannot use."""
    cls = _class_name(mod)
    # is_transposed (GPT-OSS): gate_up_proj [E, H, 2F] and down_proj [E, F, H], read in place as well.
    transposed = _module_flag(mod, "is_transposed", False)
    has_gate = _module_flag(mod, "has_gate", True)
    has_bias = _module_flag(mod, "has_bias", False)
    spec = _Spec()
    spec.w1_name = "gate_up_proj" if has_gate else "up_proj"
    spec.b1_name = spec.w1_name + "_bias"
    w1, w2 = getattr(mod, spec.w1_name, None), getattr(mod, "down_proj", None)
    orient = "[E, in, out]" if transposed else "[E, out, in]"
    if not isinstance(w1, torch.Tensor) or w1.dim() != 3:
        raise ValueError(f"moe_engine: {cls}.{spec.w1_name} should be an {orient} expert weight tensor")
    if not isinstance(w2, torch.Tensor) or w2.dim() != 3:
        raise ValueError(f"moe_engine: {cls}.down_proj should be an {orient} expert weight tensor")
    if transposed:
        E, H, fc1_out = w1.shape
        F = w2.shape[1]
    else:
        E, fc1_out, H = w1.shape
        F = w2.shape[2]
    if has_gate and fc1_out != 2 * F:
        raise ValueError(f"moe_engine: {cls}.gate_up_proj has {fc1_out} output features, expected 2 * F = {2 * F} "
                         f"(F from down_proj {tuple(w2.shape)})")
    _check_weight(mod, spec.w1_name, w1, (E, H, fc1_out) if transposed else (E, fc1_out, H))
    _check_weight(mod, "down_proj", w2, (E, F, H) if transposed else (E, H, F))
    spec.transposed = transposed
    spec.w1, spec.w2 = w1, w2
    spec.b1 = spec.b2 = None
    if has_bias:
        spec.b1, spec.b2 = getattr(mod, spec.b1_name, None), getattr(mod, "down_proj_bias", None)
        _check_weight(mod, spec.b1_name, spec.b1, (E, fc1_out))
        _check_weight(mod, "down_proj_bias", spec.b2, (E, H))
    spec.hidden, spec.ffn, spec.experts = H, F, E
    spec.interleave = 0 if (not has_gate or _module_flag(mod, "is_concatenated", True)) else 1
    _activation(mod, spec, has_gate)
    return spec


# ---------------------------------------------------------------------------------------------
# One moe_engine layer object per experts module


class _Layer:
    """A moe::GroupedMlp op object (configuration and workspaces; the weights come with each call).
    Destroyed when the last reference goes: the experts module's cache entry and the autograd
    contexts of forwards still waiting for their backward."""

    def __init__(self, key, max_tokens, device, spec):
        H, F, E, k, activation, interleave, alpha, limit, offset, bias, transposed, _, fp8 = key
        self.key, self.max_tokens, self.topk = key, max_tokens, k
        # The fused fc1 where GroupedMLP's default takes it (F <= 2048), keeping x_perm and the
        # unfused fc2 dgrad; it reads the [E, out, in] orientation only, so transposed experts run the
        # unfused path. FP8: the unfused path on expert rows aligned to the 128-row blocks.
        fuse_fc1 = _fuse_fc1(None, F, E) and not transposed and fp8 is None
        align = 128 if fp8 is not None else 0
        with torch.cuda.device(device):
            self.handle = _ops.mlp_create(H, F, E, k, max_tokens, activation, interleave, alpha, limit, offset, bias,
                                          False, align, False, -1, False, False, False, False, False, False, fuse_fc1,
                                          True, False, transposed, fp8 or "none")
        self.state_bytes = _ops.mlp_state_bytes(self.handle)
        # bf16 copies of full-precision weights (a model kept in fp32 under autocast), one per tensor that
        # is not bf16, written by each forward. The op binds weights by address at forward and its
        # backward reads them there, so they belong to this layer object: a per-call copy could be freed
        # (and its memory reused) before the backward. A backward therefore reads the copy as the latest
        # forward on this layer left it -- the rule of the bf16 path, which reads the parameters as they
        # are (not a per-forward snapshot, as autocast keeps for nn.Linear). A forward allocates nothing
        # (graph capture). The copies live as long as the layer object: half the fp32 weights' size.
        self.copies = tuple(None if t is None or t.dtype == torch.bfloat16 else
                            torch.empty(t.shape, dtype=torch.bfloat16, device=device) for t in spec.tensors())

    def bf16_weights(self, tensors):
        """The tensors the op reads for (w1, w2, b1, b2): bf16 ones as they are, the others cast into
        this layer's copies."""
        return tuple(t if c is None else c.copy_(t) for t, c in zip(tensors, self.copies))

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle is not None:
            release(_ops.mlp_destroy, handle)


_layers = weakref.WeakKeyDictionary()  # experts module -> _Layer


def _round_up_tokens(n):
    return max(_MIN_TOKENS, 1 << max(0, int(n - 1).bit_length()))


def _layer_for(mod, spec, tokens, topk, device, fp8=None):
    if fp8 is not None and spec.transposed:
        raise NotImplementedError(
            f"moe_engine_fp8: {_class_name(mod)} stores its experts transposed (is_transposed, x @ W), which the FP8 "
            "experts do not read; use experts_implementation=\"moe_engine\"")
    key = spec.key(topk) + (fp8,)
    layer = _layers.get(mod)
    if layer is not None and layer.key == key and tokens <= layer.max_tokens:
        return layer
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"moe_engine: {_class_name(mod)} needs a layer for {tokens} tokens during CUDA graph capture, which "
            "would allocate workspaces; call moe_engine.integrations.transformers.reserve(experts_module, "
            f"max_tokens, topk{', fp8=' + repr(fp8) if fp8 is not None else ''}) before capturing")
    bound = _round_up_tokens(max(tokens, layer.max_tokens if layer is not None and layer.key == key else 0))
    layer = _Layer(key, bound, device, spec)
    _layers[mod] = layer
    return layer


def reserve(experts_module, max_tokens, topk, fp8=None):
    """Makes the experts module's layer for up to `max_tokens` tokens of `topk` experts now (before a
    CUDA graph capture, or to avoid growing step by step); fp8="block" for "moe_engine_fp8". Returns
    the token bound."""
    if fp8 not in (None, "block"):
        raise ValueError(f"argument 'fp8': expected None (\"moe_engine\") or 'block' (\"moe_engine_fp8\"), got {fp8!r}")
    spec = describe(experts_module)
    return _layer_for(experts_module, spec, max_tokens, topk, spec.w1.device, fp8).max_tokens


def layer_tokens(experts_module):
    """The token bound of the experts module's current layer (0 when it has none yet)."""
    layer = _layers.get(experts_module)
    return 0 if layer is None else layer.max_tokens


# ---------------------------------------------------------------------------------------------
# The differentiable call


def _check_autocast(mod, spec):
    """Full-precision weights (fp32 / fp16: a model kept in full precision and trained under autocast)
    run only under a bf16 autocast: the layer computes in bf16, and casts them into its bf16 copies
    for each forward, as autocast casts an nn.Linear's weight; their gradients are returned in the
    parameters' dtype. Without a bf16 autocast they are refused: a full-precision model run outside
    autocast asks for more than bf16 arithmetic."""
    named = ((spec.w1_name, spec.w1), ("down_proj", spec.w2), (spec.b1_name, spec.b1), ("down_proj_bias", spec.b2))
    wide = [(n, t) for n, t in named if t is not None and t.dtype != torch.bfloat16]
    if wide and not _bf16_autocast():
        n, t = wide[0]
        active = (f"the active autocast is {torch.get_autocast_dtype('cuda')}" if torch.is_autocast_enabled("cuda")
                  else "no autocast is active")
        raise ValueError(f"moe_engine: {_class_name(mod)}.{n} is {t.dtype} and {active}; moe_engine computes in bf16: "
                         "load the model with dtype=torch.bfloat16 (its weights are then read in place), or run it "
                         "under torch.autocast('cuda', dtype=torch.bfloat16) (the weights are cast for each call)")


def _routing_weights(top_k_weights, top_k_index, valid, E, cls):
    """[T, k] fp32 routing weights, one per slot. A router's dense [T, E] weights (one per expert; taken
    as such only where E != k) are gathered at each slot's expert, differentiably (the gradient goes to
    the chosen entries). A sentinel slot (`valid` False) reads entry 0 and gets no gradient from the op."""
    T, k = top_k_index.shape
    if top_k_weights.dim() == 2 and tuple(top_k_weights.shape) == (T, k):
        return top_k_weights.float().contiguous()
    if top_k_weights.dim() == 2 and tuple(top_k_weights.shape) == (T, E):
        safe = torch.where(valid, top_k_index, 0).long()
        return top_k_weights.gather(1, safe).float().contiguous()
    raise ValueError(f"moe_engine: {cls}: top_k_weights should be [T, k] = [{T}, {k}] like top_k_index, or "
                     f"[T, E] = [{T}, {E}], got {tuple(top_k_weights.shape)}")


class _ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, x, routing, probs, w1, w2, b1, b2):
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (w1, w2, b1, b2))
        # The parameters read in place must stay there until the backward (its copies hold the others).
        in_place = [t for t, c in zip((w1, w2, b1, b2), layer.copies) if t is not None and c is None]
        addresses = _weight_addresses(ctx, in_place)
        w1, w2, b1, b2 = layer.bf16_weights((w1, w2, b1, b2))
        ctx.bound = (w1, w2, b1, b2)  # what the op reads (parameters in place, or the layer's copies)
        biases = ([b1], [b2]) if b1 is not None else ([], [])
        y, state, header = _ops.mlp_forward(layer.handle, x, routing, probs, [w1], biases[0], [w2], biases[1],
                                            layer.state_bytes)
        ctx.layer = layer  # keeps the op object alive until this backward, even if the module grew a new one
        ctx.shapes = (w1.shape, w2.shape, None if b1 is None else b1.shape, None if b2 is None else b2.shape)
        ctx.save_for_backward(state, header, addresses)  # x is read again only in recompute mode (off here)
        return y

    @staticmethod
    def backward(ctx, dy):
        state, header, addresses = ctx.saved_tensors
        layer = ctx.layer
        w1, w2, b1, b2 = ctx.bound
        rebind_moved_weights(ctx, addresses, lambda: _ops.mlp_rebind_weights(
            layer.handle, [w1], [] if b1 is None else [b1], [w2], [] if b2 is None else [b2]))

        need = ctx.needs_input_grad
        # Frozen experts (no parameter wants a gradient, e.g. adapters trained around them): no
        # buffers, and the op computes dx and the probs' gradient only.
        frozen = not any(need[4:8])

        def buffer(shape):
            return [] if shape is None or frozen else [torch.empty(shape, dtype=torch.bfloat16, device=dy.device)]

        gw1, gw2, gb1, gb2 = (buffer(s) for s in ctx.shapes)
        dx, dprobs = _ops.mlp_backward(layer.handle, state, header, None, dy.contiguous(), layer.topk, gw1, gb1,
                                       gw2, gb2)

        def grad(lst, i):  # in the parameter's dtype (the bf16 gradient of a full-precision weight cast)
            return lst[0].to(ctx.dtypes[i - 4]) if lst and need[i] else None

        return (None, dx if need[1] else None, None, dprobs if need[3] else None, grad(gw1, 4), grad(gw2, 5),
                grad(gb1, 6), grad(gb2, 7))


def moe_engine_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "moe_engine" entry of transformers' ALL_EXPERTS_FUNCTIONS (see the module docstring)."""
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, None)


def moe_engine_fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "moe_engine_fp8" entry: the same with the GEMMs in FP8 block scaling (see the module docstring)."""
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, "block")


def _experts_forward(self, hidden_states, top_k_index, top_k_weights, fp8):
    spec = describe(self)
    cls = _class_name(self)
    if hidden_states.dim() != 2 or hidden_states.shape[1] != spec.hidden:
        raise ValueError(f"moe_engine: {cls}: hidden_states should be [T, {spec.hidden}], got {tuple(hidden_states.shape)}")
    T = hidden_states.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T:
        raise ValueError(f"moe_engine: {cls}: top_k_index should be [T={T}, k], got {tuple(top_k_index.shape)}")
    if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
        raise ValueError(f"moe_engine: {cls}: top_k_index should hold integer expert ids, got {top_k_index.dtype}")
    k = top_k_index.shape[1]
    if not top_k_weights.is_floating_point():
        raise ValueError(f"moe_engine: {cls}: top_k_weights should be floating point, got {top_k_weights.dtype}")
    E = spec.experts
    # Expert-parallel sentinels (ids >= E, or anything outside [0, E)) become empty slots.
    valid = (top_k_index >= 0) & (top_k_index < E)
    probs = _routing_weights(top_k_weights, top_k_index, valid, E, cls)
    routing = torch.where(valid, top_k_index, -1).to(torch.int32).contiguous()
    _check_autocast(self, spec)
    x = hidden_states.to(torch.bfloat16).contiguous()
    layer = _layer_for(self, spec, T, k, spec.w1.device, fp8)
    y = _ExpertsFunction.apply(layer, x, routing, probs, *spec.tensors())
    return y.to(hidden_states.dtype)


def register():
    """Adds "moe_engine" and "moe_engine_fp8" to transformers' experts implementations
    (ALL_EXPERTS_FUNCTIONS). Idempotent; called when this module is imported."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(NAME, moe_engine_experts_forward)
    ExpertsInterface.register(NAME_FP8, moe_engine_fp8_experts_forward)


register()
