"""Functional operators with autograd: token dispatch (permute + pad, unpermute + unpad) and the
grouped GEMM. All run on the current CUDA stream, allocate only through PyTorch's allocator, and
make no host synchronisation, so they can sit inside torch.cuda.graph."""
import torch

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


class Dispatcher:
    """Permute + pad and unpermute + unpad for one static configuration (SPEC 2-3).

    permute(x, routing, probs) -> (x_perm [R, H], probs_perm [R], group_offsets [E + 1],
    tokens_per_expert [E]); unpermute(Y, probs, merge_probs) -> y [T, H]. Both are differentiable
    (dx, and dprobs through probs_perm or through the merge). The plan of the last permute is used
    by unpermute and by both backwards: permute and unpermute one batch at a time."""

    def __init__(self, max_tokens, num_experts, hidden_size, topk=0, map_routing=False, align=0,
                 pre_padded=False, row_bound=-1, dtype=torch.bfloat16):
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        if dtype not in names:
            raise ValueError(f"argument 'dtype': expected bfloat16, float16 or float32, got {dtype}")
        self.num_experts = num_experts
        self.slots = num_experts if map_routing else topk
        self.handle = _ops.dispatcher_create(max_tokens, num_experts, topk, hidden_size, map_routing, align,
                                             pre_padded, row_bound, names[dtype])
        self.rows = _ops.dispatcher_rows(self.handle)
        self.tokens = 0

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle is not None:
            _ops.dispatcher_destroy(handle)

    def permute(self, x, routing, probs):
        self.tokens = x.shape[0]
        return _Permute.apply(self, x, routing, probs)

    def unpermute(self, Y, probs, merge_probs=True):
        return _Unpermute.apply(self, Y, probs, merge_probs)

    def check_errors(self):
        """Raises ValueError if routing entries were skipped (bad expert id, duplicate, non-finite
        prob) or rows overflowed R since the last check. Synchronises: call outside graphs."""
        _ops.dispatcher_check_errors(self.handle)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, d, x, routing, probs):
        ctx.d = d
        x_perm, probs_perm, groups, counts = _ops.dispatch_permute(d.handle, x, routing, probs, d.rows,
                                                                   d.num_experts)
        ctx.mark_non_differentiable(groups, counts)
        return x_perm, probs_perm, groups, counts

    @staticmethod
    def backward(ctx, d_x_perm, d_probs_perm, _g, _c):
        d = ctx.d
        dx, dprobs = _ops.dispatch_permute_backward(d.handle, d_x_perm.contiguous(), d_probs_perm, d.tokens,
                                                    d.slots)
        return None, dx, None, dprobs


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, d, Y, probs, merge_probs):
        ctx.d, ctx.merge = d, merge_probs
        ctx.save_for_backward(Y)
        return _ops.dispatch_unpermute(d.handle, Y, merge_probs, d.tokens)

    @staticmethod
    def backward(ctx, dy):
        (Y,) = ctx.saved_tensors
        d = ctx.d
        dY, dprobs = _ops.dispatch_unpermute_backward(d.handle, dy.contiguous(), Y, ctx.merge, d.slots)
        return None, dY, (dprobs if ctx.merge else None), None
