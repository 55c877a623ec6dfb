"""Functional operators with autograd: token dispatch (permute + pad, unpermute + unpad) and the
grouped GEMM. All run on the current CUDA stream, allocate only through PyTorch's allocator, and
make no host synchronisation, so they can sit inside torch.cuda.graph."""
import torch

from ._handles import HandleOwner

_ops = torch.ops.moe_engine


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_offsets):
        ctx.save_for_backward(x, w, group_offsets)
        return _ops.grouped_mm(x, w, group_offsets)

    @staticmethod
    def backward(ctx, dy):
        x, w, groups = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _ops.grouped_mm_dgrad(dy, w, groups) if ctx.needs_input_grad[0] else None
        dw = _ops.grouped_mm_wgrad(dy, x, groups) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm(x, w, group_offsets):
    """y[g[e]:g[e+1]] = x[g[e]:g[e+1]] @ w[e].T for every expert e.

    x bf16 [R, K], w bf16 [E, N, K], group_offsets int32 [E + 1] on the device (g[0] = 0,
    non-decreasing); rows past g[E] of y are zero. Differentiable in x and w."""
    return _GroupedMM.apply(x, w, group_offsets)


def grouped_mm_check_errors():
    """Raises ValueError if a grouped_mm call since the last check got group offsets that were not
    0-based, decreased, or ran past the rows (they were clamped). Synchronises: call outside graphs."""
    _ops.grouped_mm_check_errors()


class DispatchPlan:
    """The plan of one permute (counts, offsets, row maps, probs_perm) as tensors: device memory and
    a CPU header. Made by Dispatcher.permute; unpermute and both backwards take it. Any number of
    plans may be alive (micro-batches in flight)."""

    def __init__(self, plan, header, tokens):
        self.plan, self.header, self.tokens = plan, header, tokens


class Dispatcher(HandleOwner):
    """Permute + pad and unpermute + unpad for one static configuration (docs/semantics.md).

    permute(x, routing, probs) -> (x_perm [R, H], probs_perm [R], group_offsets [E + 1],
    tokens_per_expert [E], plan); unpermute(Y, plan, probs=None) -> y [T, H], merged with `probs`
    when given. Both are differentiable (dx; dprobs through probs_perm or through the merge). The
    dispatcher holds configuration only: each call uses the plan it is given."""

    _DESTROY = "dispatcher_destroy"

    def __init__(self, max_tokens, num_experts, hidden_size, topk=0, map_routing=False, align=0,
                 pre_padded=False, row_bound=-1, dtype=torch.bfloat16):
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        if dtype not in names:
            raise ValueError(f"argument 'dtype': expected bfloat16, float16 or float32, got {dtype}")
        self.num_experts = num_experts
        self.slots = num_experts if map_routing else topk
        self._make_handle("dispatcher_create", max_tokens, num_experts, topk, hidden_size, map_routing,
                          align, pre_padded, row_bound, names[dtype])
        self.rows = _ops.dispatcher_rows(self.handle)
        self.plan_bytes = _ops.dispatcher_plan_bytes(self.handle)

    def permute(self, x, routing, probs):
        x_perm, probs_perm, groups, counts, plan, header = _Permute.apply(self, x, routing, probs)
        return x_perm, probs_perm, groups, counts, DispatchPlan(plan, header, x.shape[0])

    def unpermute(self, Y, plan, probs=None):
        if not isinstance(plan, DispatchPlan):
            raise ValueError(f"argument 'plan': expected the DispatchPlan returned by permute, got {type(plan)}")
        return _Unpermute.apply(self, Y, plan.plan, plan.header, plan.tokens, probs)

    def check_errors(self):
        """Raises ValueError if routing entries were skipped (bad expert id, duplicate, non-finite
        prob) or rows overflowed R since the last check. Synchronises: call outside graphs."""
        _ops.dispatcher_check_errors(self.handle)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, d, x, routing, probs):
        x_perm, probs_perm, groups, counts, plan, header = _ops.dispatch_permute(
            d.handle, x.contiguous(), routing.contiguous(), probs.contiguous(), d.rows, d.num_experts, d.plan_bytes)
        ctx.d, ctx.tokens = d, x.shape[0]
        ctx.save_for_backward(plan, header)
        ctx.mark_non_differentiable(groups, counts, plan, header)
        return x_perm, probs_perm, groups, counts, plan, header

    @staticmethod
    def backward(ctx, d_x_perm, d_probs_perm, _g, _c, _p, _h):
        d = ctx.d
        plan, header = ctx.saved_tensors
        dx, dprobs = _ops.dispatch_permute_backward(d.handle, plan, header, d_x_perm.contiguous(), d_probs_perm,
                                                    ctx.tokens, d.slots)
        return None, dx, None, dprobs


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, d, Y, plan, header, tokens, probs):
        Y = Y.contiguous()
        probs = None if probs is None else probs.contiguous()
        ctx.d = d
        ctx.save_for_backward(Y, plan, header, probs)
        return _ops.dispatch_unpermute(d.handle, plan, header, Y, probs, tokens)

    @staticmethod
    def backward(ctx, dy):
        Y, plan, header, probs = ctx.saved_tensors
        d = ctx.d
        dY, dprobs = _ops.dispatch_unpermute_backward(d.handle, plan, header, dy.contiguous(), Y, probs, d.slots)
        return None, dY, None, None, None, (dprobs if probs is not None else None)
