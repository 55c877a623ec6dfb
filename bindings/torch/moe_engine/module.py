"""GroupedMLP: the moe-engine expert layer as a torch.nn.Module.

Parameters live in `fc1` and `fc2` submodules, named as in SPEC 5:
  single grouped:  fc1.weight [E, fc1_out, H], fc1.bias [E, fc1_out], fc2.weight [E, H, F], fc2.bias [E, H]
  per expert:      fc1.weight0 .. fc1.weight{E-1} [fc1_out, H], ... (the same for bias and fc2)
fc1_out = 2F for gated activations (gate rows, then linear rows, or GLU-interleaved blocks of
`glu_interleave` rows), F for squared-relu. load_state_dict accepts either layout.

Weight gradients:
  - default: returned to autograd (param.grad), bf16 or fp32 (`wgrad_dtype`);
  - accumulate_into_main_grad=True (Megatron "gradient accumulation fusion"): added into the fp32
    `param.main_grad` each parameter must carry; autograd gets None and `param.grad_added_to_main_grad`
    is set;
  - delay_wgrad=True: backward produces dx and dprobs only; `backward_dw()` later computes fc2's,
    then fc1's weight gradients (e.g. overlapped with communication).
Hooks registered with `register_wgrad_hook(fn)` are called as fn(name, param) once per step when that
parameter's gradient is final -- the place for a data-parallel reducer's reduce-scatter: with
main_grad, at the end of backward (fc2 before fc1); when delayed, in backward_dw (fc2 before fc1);
otherwise once autograd has accumulated it into param.grad (autograd's order).

Each forward has exactly one backward (the layer keeps one step's activations): a second forward
before the first one's backward, or a second backward of one forward, raises RuntimeError."""
import torch
from torch import nn

from .state_dict import normalize_expert_keys

_ops = torch.ops.moe_engine
_GATED = {"swiglu", "geglu", "clamped-swiglu"}
_ORDER = (("fc2", "weight"), ("fc2", "bias"), ("fc1", "weight"), ("fc1", "bias"))


class GroupedMLP(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_experts, topk, max_tokens, activation="swiglu",
                 glu_interleave=0, bias=False, probs_at_combine=False, align=0, pre_padded=False, row_bound=-1,
                 map_routing=False, per_expert_weights=False, accumulate_into_main_grad=False,
                 wgrad_dtype=torch.bfloat16, delay_wgrad=False, clamp_alpha=1.702, clamp_limit=7.0,
                 clamp_offset=1.0, device=None, init_std=None):
        super().__init__()
        if wgrad_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"argument 'wgrad_dtype': expected torch.bfloat16 or torch.float32, got {wgrad_dtype}")
        if wgrad_dtype == torch.float32 and not accumulate_into_main_grad:
            raise ValueError("argument 'wgrad_dtype': fp32 weight gradients go to an fp32 main_grad "
                             "(accumulate_into_main_grad=True); param.grad must match the bf16 parameters")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.topk = num_experts, topk
        self.per_expert_weights = per_expert_weights
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.wgrad_dtype = wgrad_dtype
        self.delay_wgrad = delay_wgrad
        self.has_bias = bias
        self.slots = num_experts if map_routing else topk
        fc1_out = 2 * ffn_hidden_size if activation in _GATED else ffn_hidden_size
        self._shapes = {("fc1", "weight"): (fc1_out, hidden_size), ("fc1", "bias"): (fc1_out,),
                        ("fc2", "weight"): (hidden_size, ffn_hidden_size), ("fc2", "bias"): (hidden_size,)}
        device = torch.device("cuda") if device is None else torch.device(device)
        self._handle = _ops.mlp_create(hidden_size, ffn_hidden_size, num_experts, topk, max_tokens, activation,
                                       glu_interleave, clamp_alpha, clamp_limit, clamp_offset, bias,
                                       probs_at_combine, align, pre_padded, row_bound, map_routing,
                                       per_expert_weights, accumulate_into_main_grad,
                                       wgrad_dtype == torch.float32, delay_wgrad)
        self.fc1, self.fc2 = nn.Module(), nn.Module()
        for (p, s), shape in self._shapes.items():
            if s == "bias" and not bias:
                continue
            std = init_std if init_std is not None else (shape[-1] ** -0.5 if s == "weight" else 0.0)
            owner = getattr(self, p)
            if per_expert_weights:
                for e in range(num_experts):
                    owner.register_parameter(f"{s}{e}", nn.Parameter(self._init(shape, std, device)))
            else:
                owner.register_parameter(s, nn.Parameter(self._init((num_experts, *shape), std, device)))
        self._hooks = []
        self._pending_dw = None  # delayed mode: gradient buffers waiting for backward_dw
        self._forward_id = 0     # the forward whose activations the layer holds
        self._register_load_state_dict_pre_hook(self._normalize_keys)
        if not accumulate_into_main_grad and not delay_wgrad:
            # Write mode: a gradient is final once autograd has accumulated it into param.grad.
            for name, q in self.named_parameters():
                q.register_post_accumulate_grad_hook(lambda q, name=name: self._fire_hook(name, q))

    @staticmethod
    def _init(shape, std, device):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        return t.normal_(0.0, std) if std > 0 else t.zero_()

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None:
            _ops.mlp_destroy(handle)

    # -- parameters --------------------------------------------------------------------------
    def expert_params(self, p, s):
        """The parameter(s) of fc1/fc2 weight/bias: [grouped] or [expert 0, .., expert E-1]."""
        if s == "bias" and not self.has_bias:
            return []
        owner = getattr(self, p)
        if self.per_expert_weights:
            return [getattr(owner, f"{s}{e}") for e in range(self.num_experts)]
        return [getattr(owner, s)]

    def _param_lists(self):
        return [self.expert_params(p, s) for p, s in (("fc1", "weight"), ("fc1", "bias"), ("fc2", "weight"),
                                                      ("fc2", "bias"))]

    def _normalize_keys(self, state_dict, prefix, *args, **kwargs):
        normalize_expert_keys(state_dict, prefix, self.num_experts, self.per_expert_weights)

    def register_wgrad_hook(self, fn):
        """fn(name, param) once per step for each parameter whose weight gradient is final."""
        self._hooks.append(fn)

    def _fire_hook(self, name, param):
        for fn in self._hooks:
            fn(name, param)

    def _fire_hooks(self):
        for p, s in _ORDER:
            for i, param in enumerate(self.expert_params(p, s)):
                self._fire_hook(f"{p}.{s}{i}" if self.per_expert_weights else f"{p}.{s}", param)

    def _grad_buffers(self):
        """Where the layer writes weight gradients: main_grad (accumulate) or new grouped buffers."""
        lists = []
        for p, s in (("fc1", "weight"), ("fc1", "bias"), ("fc2", "weight"), ("fc2", "bias")):
            params = self.expert_params(p, s)
            if not params:
                lists.append([])
            elif self.accumulate_into_main_grad:
                for q in params:
                    if getattr(q, "main_grad", None) is None:
                        raise ValueError(f"accumulate_into_main_grad: parameter {p}.{s} has no fp32 'main_grad'")
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

    # -- compute -------------------------------------------------------------------------------
    def forward(self, x, routing, probs):
        """x bf16 [T, H]; routing int32 [T, k] top-k indices (-1 = empty) or bool/uint8 [T, E] map;
        probs fp32 like routing. Returns y bf16 [T, H]."""
        params = [q for lst in self._param_lists() for q in lst]
        return _MlpFunction.apply(self, x, routing, probs, *params)

    def backward_dw(self):
        """Delayed mode: computes the weight gradients of the last backward, fc2 then fc1, and fires
        the wgrad hooks. Gradients go to main_grad (accumulate) or are added to param.grad."""
        if not self.delay_wgrad:
            raise RuntimeError("backward_dw: only for delay_wgrad=True")
        if self._pending_dw is None:
            raise RuntimeError("backward_dw: no pending weight gradients (run backward first)")
        lists, self._pending_dw = self._pending_dw, None
        _ops.mlp_backward_dw(self._handle, *lists)
        if not self.accumulate_into_main_grad:
            params = [q for lst in self._param_lists() for q in lst]
            for q, g in zip(params, self._as_param_grads(lists)):
                q.grad = g if q.grad is None else q.grad + g
        else:
            self._mark_main_grad()
        self._fire_hooks()

    def _mark_main_grad(self):
        for lst in self._param_lists():
            for q in lst:
                q.grad_added_to_main_grad = True

    def check_errors(self):
        """Raises ValueError if routing entries were skipped (bad expert id, duplicate expert,
        non-finite prob) or rows overflowed R. Synchronises: call outside CUDA graphs."""
        _ops.mlp_check_errors(self._handle)

    def workspace_bytes(self):
        return _ops.mlp_workspace_bytes(self._handle)


class _MlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mod, x, routing, probs, *params):
        mod._forward_id += 1
        ctx.mod, ctx.forward_id = mod, mod._forward_id
        ctx.n_params = len(params)
        return _ops.mlp_forward(mod._handle, x.contiguous(), routing.contiguous(), probs.contiguous(),
                                *mod._param_lists())

    @staticmethod
    def backward(ctx, dy):
        mod = ctx.mod
        if ctx.forward_id != mod._forward_id:
            raise RuntimeError("GroupedMLP: this backward belongs to an earlier forward; the layer holds the "
                               "activations of its latest forward only (one backward per forward)")
        dy = dy.contiguous()
        param_grads = [None] * ctx.n_params
        if mod.delay_wgrad:
            dx, dprobs = _ops.mlp_backward(mod._handle, dy, mod.slots, [], [], [], [])
            mod._pending_dw = mod._grad_buffers()
        else:
            lists = mod._grad_buffers()
            dx, dprobs = _ops.mlp_backward(mod._handle, dy, mod.slots, *lists)
            if mod.accumulate_into_main_grad:
                mod._mark_main_grad()
                mod._fire_hooks()
            else:
                param_grads = mod._as_param_grads(lists)  # hooks fire after autograd accumulates them
        return (None, dx, None, dprobs, *param_grads)
