"""Router and experts as one module: the gate (a linear layer H -> E), the fused Router and
GroupedMLP, the whole MoE block of a transformer layer.

    layer = MoELayer(hidden_size=2048, ffn_hidden_size=768, num_experts=128, topk=8,
                     max_tokens=16384, router="qwen3")
    y, routed = layer(x)                  # x [..., H] bf16 (fp32 under a bf16 autocast) -> y bf16
    loss = lm_loss + routed.aux_loss      # the router's losses, when their coefficients are set

`router` names the routing of a model family (the Router presets: "mixtral", "qwen3", "olmoe",
"gpt_oss", "deepseek_v3") or "softmax" (softmax over the experts, top-k, no renormalisation);
`router_options` are further Router arguments (losses, capacity, token rounding, map form, ...,
docs/router.md) and every other keyword argument goes to GroupedMLP (activation, biases, fused
kernels, ...). The routing goes from the router to the experts as it is, so a forward and a
backward need no host synchronisation and can be captured in a CUDA graph like their parts.

The gate computes the logits as the Hugging Face blocks do: in the input's dtype, or in fp32 for
DeepSeek-V3 (`logits_dtype`; under a bf16 autocast too, where Hugging Face's fp32 gate would run in
bf16), with a bias for GPT-OSS (`gate_bias`). x feeds both the gate and the experts, so its gradient
is a sum of two: a bf16 gate (a plain `nn.Linear` without hooks) adds its part into the experts'
in its own backward GEMM (beta = 1), which reads the experts' dx once and writes the sum once, where
autograd would write the gate's part and then read both to add them -- the same sum rounded once
instead of twice. Its parameters are
`gate.weight` [E, H] (and `gate.bias` [E]), the keys those blocks use; the experts' parameters are
under `experts.` (GroupedMLP's keys) and the router's buffers (expert_bias, tokens_per_expert)
under `router.`."""
import torch
import torch.nn.functional as F
from torch import nn

from .module import GroupedMLP, _activation_input, _bf16_autocast
from .router import Router

_PRESETS = {"softmax": Router, "mixtral": Router.mixtral, "qwen3": Router.qwen3, "olmoe": Router.olmoe,
            "gpt_oss": Router.gpt_oss, "deepseek_v3": Router.deepseek_v3}


class _GateAndInput(torch.autograd.Function):
    """logits = x W^T (+ b), and x itself for the experts, as one autograd node: its backward gets the
    logits' gradient and the experts' dx together and adds the gate's part of dx into the experts'
    with one GEMM (addmm: dx_experts + d_logits W). dx_owned: the experts' dx is a tensor nothing
    else holds (the experts' op allocates it, no module hook sees it), so the GEMM adds into it in
    place (beta = 1, C = D); out of place, addmm first copies it, a T x H pass more."""

    @staticmethod
    def forward(ctx, x, weight, bias, dx_owned=False):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.dx_owned = dx_owned
        return F.linear(x, weight, bias), x.view_as(x)

    @staticmethod
    def backward(ctx, d_logits, d_x):
        x, weight = ctx.saved_tensors
        if d_logits is None:
            return d_x, None, None, None
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if d_x is None:
                dx = d_logits.mm(weight)
            else:
                dx = d_x.addmm_(d_logits, weight) if ctx.dx_owned else torch.addmm(d_x, d_logits, weight)
        if ctx.needs_input_grad[1]:
            dw = d_logits.t().mm(x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = d_logits.sum(0)
        return dx, dw, db, None


def _backward_hooked(module):
    """Whether a module backward hook (the module's own or a global one) sees the module's gradients."""
    glob = nn.modules.module
    return bool(module._backward_hooks or module._backward_pre_hooks or glob._global_backward_hooks
                or glob._global_backward_pre_hooks)


def _map_row_bound(max_tokens, topk, num_experts, router_options, experts_options):
    """Expert rows map-form routing can give: T * k, plus what token rounding up may add (less than
    one tile per expert) and the per-expert alignment padding."""
    rows = max_tokens * topk
    if router_options.get("rounding", "none") in ("up", "nearest"):
        rows += num_experts * (router_options.get("rounding_tile", 128) - 1)
    align = experts_options.get("align", 0)
    if align and not experts_options.get("pre_padded", False):
        rows += num_experts * (align - 1)
    return rows


class MoELayer(nn.Module):
    """gate -> Router -> GroupedMLP. forward(x [..., H] bf16) -> (y [..., H], RouterOutput).

    hidden_size, ffn_hidden_size, num_experts, topk, max_tokens: as GroupedMLP's (max_tokens bounds
    the tokens of one call, i.e. the product of x's leading dimensions). router: "softmax" or a
    preset name (above); router_options: more Router arguments. logits_dtype: the dtype of the gate's
    product, None = fp32 for "deepseek_v3" and x's dtype otherwise (as Hugging Face computes them).
    gate_bias: None = True for "gpt_oss" only. gate_init_std: the gate weight's normal init.
    device: where the parameters live (default: the current CUDA device). Other keyword arguments
    go to GroupedMLP; in map form (router_options output_form="map") its row_bound defaults to
    what the routing can give."""

    def __init__(self, hidden_size, ffn_hidden_size, num_experts, topk, max_tokens, router="softmax",
                 router_options=None, logits_dtype=None, gate_bias=None, gate_init_std=0.02, device=None,
                 **experts_options):
        super().__init__()
        if router not in _PRESETS:
            raise ValueError(f"argument 'router': expected one of {', '.join(_PRESETS)}, got {router!r}")
        if logits_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"argument 'logits_dtype': expected None, torch.float32 or torch.bfloat16, got "
                             f"{logits_dtype}")
        if "map_routing" in experts_options:
            raise ValueError("argument 'map_routing': set by the router's output form (router_options "
                             "output_form='map')")
        router_options = dict(router_options or {})
        device = torch.device("cuda") if device is None else torch.device(device)
        self.hidden_size, self.num_experts, self.topk = hidden_size, num_experts, topk
        self.logits_dtype = logits_dtype if logits_dtype is not None else (
            torch.float32 if router == "deepseek_v3" else None)
        gate_bias = router == "gpt_oss" if gate_bias is None else gate_bias
        self.gate = nn.Linear(hidden_size, num_experts, bias=gate_bias, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            self.gate.weight.normal_(0.0, gate_init_std)
            if gate_bias:
                self.gate.bias.zero_()
        self.router = _PRESETS[router](num_experts, topk, max_tokens, **router_options).to(device)
        map_form = self.router.map_output
        if map_form and "row_bound" not in experts_options:
            experts_options["row_bound"] = _map_row_bound(max_tokens, topk, num_experts, router_options,
                                                          experts_options)
        self.experts = GroupedMLP(hidden_size, ffn_hidden_size, num_experts, topk, max_tokens,
                                  map_routing=map_form, device=device, **experts_options)

    def logits(self, x2d):
        """The gate's logits [T, E] for x [T, H]: in x's dtype (under an autocast, its dtype), or in
        logits_dtype -- whose forward product runs with autocast off, which would otherwise compute an
        fp32 gate in bf16 (a backward run inside the autocast region still takes its matmuls to bf16)."""
        dtype = self.logits_dtype
        if dtype is None or (dtype == x2d.dtype == self.gate.weight.dtype and not torch.is_autocast_enabled("cuda")):
            return self.gate(x2d)
        bias = self.gate.bias.to(dtype) if self.gate.bias is not None else None
        with torch.autocast("cuda", enabled=False):
            return F.linear(x2d.to(dtype), self.gate.weight.to(dtype), bias)

    def _fused_gate(self):
        """Whether the gate's backward can add into the experts' dx: a plain bf16 nn.Linear (no module
        hooks of any kind, nothing wrapped around it) whose logits stay in bf16 (bf16 x: a bf16 autocast changes nothing;
        under another autocast the gate runs as a module)."""
        gate, glob = self.gate, nn.modules.module
        autocast_ok = not torch.is_autocast_enabled("cuda") or _bf16_autocast()
        hooked = (gate._forward_hooks or gate._forward_pre_hooks or glob._global_forward_hooks
                  or glob._global_forward_pre_hooks or _backward_hooked(gate))
        return (type(gate) is nn.Linear and gate.weight.dtype == torch.bfloat16 and autocast_ok and
                self.logits_dtype in (None, torch.bfloat16) and not hooked)

    def _experts_dx_owned(self):
        """Whether the experts' dx reaches the gate's backward as a tensor nothing else holds: x_experts
        feeds the experts alone, whose op allocates dx (GroupedMLP: not a module put in its place),
        unless a module backward hook on them (or a global one) gets to see it."""
        return type(self.experts) is GroupedMLP and not _backward_hooked(self.experts)

    def forward(self, x):
        """x bf16 [..., H] (another float dtype under a bf16 autocast: cast) -> (y bf16 [..., H], routing)."""
        x = _activation_input(x)
        if x.dim() < 1 or x.shape[-1] != self.hidden_size or x.dtype != torch.bfloat16:
            raise ValueError(f"argument 'x': expected bf16 [..., {self.hidden_size}] (or a bf16 autocast), got "
                             f"{x.dtype} {list(x.shape)}")
        x2d = x.reshape(-1, self.hidden_size)
        if self._fused_gate():
            logits, x_experts = _GateAndInput.apply(x2d, self.gate.weight, self.gate.bias, self._experts_dx_owned())
        else:
            logits, x_experts = self.logits(x2d), x2d
        routed = self.router(logits)
        routing = routed.map if routed.indices is None else routed.indices
        y = self.experts(x_experts, routing, routed.probs)
        return y.reshape(x.shape), routed

    def update_bias(self):
        """The router's aux-loss-free balancing step (routers with an expert bias, e.g. deepseek_v3)."""
        self.router.update_bias()

    def backward_dw(self):
        """The experts' delayed weight gradients (GroupedMLP delay_wgrad=True)."""
        self.experts.backward_dw()

    def check_errors(self):
        """Raises if the router saw a non-finite logit or the experts a bad routing since the last
        check. Synchronises: call outside graphs."""
        self.router.check_errors()
        self.experts.check_errors()
