"""SonicMoE (Dao-AILab/sonic-moe) timed beside moe-engine in the same process, on the same tokens and
the same routing, with SonicMoE's own benchmark method: its layer under torch.compile, timed by
triton's do_bench (warm-up 5, 500 ms), forward and forward+backward, plus the peak extra memory of
one forward+backward. Its layer computes the routing itself (softmax over x @ router^T, top-k);
routing() returns that routing so moe-engine can be timed on exactly the same experts and probs.

Available only where `sonicmoe` imports (see the repository's benchmark notes on staging it)."""
import torch

try:
    import torch._functorch.config as _fconfig
    from sonicmoe import MoE
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_TC_softmax_topk_layer
    from triton.testing import do_bench
    AVAILABLE = True
except Exception:  # not staged: the comparison runs without the SonicMoE column
    AVAILABLE = False


def time_like_sonic(fn, grads=None):
    """Mean ms of fn by SonicMoE's method (triton's do_bench: warm-up 5, 500 ms, L2 flushed before each
    call), so that the other side can be timed the same way too."""
    return do_bench(fn, warmup=5, rep=500, grad_to_none=grads)


class SonicSide:
    def __init__(self, T, H, F, E, k, x, dy):
        # torch 2.11: a compiled backward with retain_graph=True (their method) needs donated buffers off.
        _fconfig.donated_buffer = False
        torch._dynamo.reset()
        self.act = ActivationType.SWIGLU
        self.moe = MoE(num_experts=E, num_experts_per_tok=k, hidden_size=H, intermediate_size=F,
                       activation_function=self.act, add_bias=False, std=0.02).to(dtype=torch.bfloat16).cuda()
        self.x, self.dy, self.k = x, dy, k

    def skew_router(self, skew):
        """Skewed routing through SonicMoE's own router, which has no bias: x's first feature becomes a
        constant 1 and the router's weight on it expert e's offset, -skew * sigma * log(1 + e) with sigma the
        spread of the logits the rest of x gives. That is the Zipf-like popularity of `moe-engine bench
        --skew` (which offsets standard-normal logits by -skew * log(1 + e)), at this router's scale. Changes
        x in place: call before anything reads it, and give every side the same x."""
        with torch.no_grad():
            w = self.moe.router.weight
            self.x[:, 0] = 0
            sigma = (self.x.float() @ w.float().t()).std().item()
            e = torch.arange(w.shape[0], device=w.device, dtype=torch.float32)
            self.x[:, 0] = 1
            w[:, 0] = (-skew * sigma * torch.log1p(e)).to(w.dtype)

    def routing(self):
        """(indices int32 [T, k], probs fp32 [T, k]) as SonicMoE's softmax-top-k router computes them."""
        with torch.no_grad():
            logits = (self.x.float() @ self.moe.router.weight.float().t())
            probs, idx = torch.topk(torch.softmax(logits, -1), self.k, dim=-1)
        return idx.to(torch.int32), probs.float()

    def _layer(self):
        m = self.moe
        return moe_TC_softmax_topk_layer(self.x, m.router.weight, m.c_fc.weight.permute(1, 2, 0), None,
                                         m.c_proj.weight.permute(1, 2, 0), None, m.top_k, m.stream_id, self.act,
                                         False)[0]

    def prepare(self):
        """Compiles the timed functions and runs one forward+backward for the peak extra memory;
        returns {"sonic_extra_gib": ...}. time_fwd() and time_fwd_bwd() may then be called
        any number of times."""
        m, x = self.moe, self.x

        @torch.compile
        def fwd():
            return self._layer()

        @torch.compile
        def fwd_bwd():
            o = self._layer()
            o.backward(self.dy, retain_graph=True)
            x.grad = m.c_fc.weight.grad = m.c_proj.weight.grad = m.router.weight.grad = None

        out = self._layer()
        assert torch.isfinite(out).all() and out.abs().mean() > 0
        self._fwd, self._fwd_bwd = fwd, fwd_bwd
        self._grads = [x, m.c_fc.weight, m.c_proj.weight, m.router.weight]
        fwd()  # compiled here, outside the memory measurement and the timing
        fwd_bwd()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        return {"sonic_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}

    def time_fwd(self):
        """Forward ms by their method: do_bench, warm-up 5, 500 ms."""
        return time_like_sonic(self._fwd)

    def time_fwd_bwd(self):
        """Forward+backward ms by their method."""
        return time_like_sonic(self._fwd_bwd, self._grads)
