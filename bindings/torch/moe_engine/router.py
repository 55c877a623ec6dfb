"""The fused router: logits [T, E] -> top-k routing for GroupedMLP (indices int32 [T, k], probs fp32
[T, k]) or map form, per-expert counts and optional balancing losses, with autograd into the logits.
One CUDA kernel pass per call, no host synchronisation (works inside torch.cuda.graph). The variants
and their formulas are in docs/router.md.

    router = Router.qwen3(num_experts=128, topk=8, max_tokens=16384)
    out = router(logits)                      # logits bf16/fp32 [T, E]
    y = mlp(x, out.indices, out.probs)        # GroupedMLP
    loss = lm_loss + out.aux_loss             # when aux_loss_coeff > 0
"""
from collections import namedtuple

import torch
from torch import nn

from ._handles import HandleOwner

_ops = torch.ops.moe_engine
_lib = "moe_engine::"

RouterOutput = namedtuple(
    "RouterOutput",
    ["indices", "map", "probs", "counts", "selection_counts", "aux_loss", "seq_aux_loss", "z_loss"],
)
RouterOutput.__doc__ = """indices int32 [T, k] (-1 = dropped) or None in map form; map bool [T, E] or None;
probs fp32 [T, k] or [T, E]; counts int64 [E] (after capacity / rounding); selection_counts int32 [E]
(top-k choices before drops); aux_loss, seq_aux_loss, z_loss: fp32 scalars (0 when off)."""


# ---- fake implementations (torch.compile / FakeTensor) ----

@torch.library.register_fake(_lib + "router_forward")
def _router_forward_fake(handle, logits, bias, experts, topk, width, map_output, sequences):
    T = logits.shape[0]
    routing = logits.new_empty((T, experts), dtype=torch.bool) if map_output else \
        logits.new_empty((T, topk), dtype=torch.int32)
    return (routing, logits.new_empty((T, experts if map_output else topk), dtype=torch.float32),
            logits.new_empty((T, width), dtype=torch.int32), logits.new_empty((experts,), dtype=torch.int32),
            logits.new_empty((experts,), dtype=torch.int64), logits.new_empty((sequences, experts), dtype=torch.int32),
            logits.new_empty((3,), dtype=torch.float32))


@torch.library.register_fake(_lib + "router_backward")
def _router_backward_fake(handle, logits, routing, selected, selection_counts, seq_counts, d_probs, d_losses):
    return torch.empty_like(logits)


@torch.library.register_fake(_lib + "router_update_bias")
def _router_update_bias_fake(counts, bias, rate):
    return None


# ---- autograd ----

class _RouterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, router, logits, bias):
        T = logits.shape[0]
        routing, probs, selected, sel_counts, counts, seq_counts, losses = _ops.router_forward(
            router.handle, logits, bias, router.num_experts, router.topk, router.width, router.map_output,
            router.sequences(T))
        ctx.router = router
        ctx.save_for_backward(logits, routing, selected, sel_counts, seq_counts)
        ctx.mark_non_differentiable(routing, sel_counts, counts)
        return routing, probs, counts, sel_counts, losses

    @staticmethod
    def backward(ctx, _routing, d_probs, _counts, _sel, d_losses):
        logits, routing, selected, sel_counts, seq_counts = ctx.saved_tensors
        r = ctx.router
        d_probs = d_probs.contiguous() if d_probs is not None else None
        d_losses = d_losses.float().contiguous() if d_losses is not None else None
        d_logits = _ops.router_backward(r.handle, logits, routing, selected, sel_counts, seq_counts, d_probs,
                                        d_losses)
        return None, d_logits, None


def update_expert_bias(counts, bias, rate):
    """bias[e] += rate * sign(mean(counts) - counts[e]) in place (DeepSeek-V3 aux-loss-free balancing,
    Megatron's rule). counts int32/int64 [E], bias fp32 [E], both CUDA. Graph-safe."""
    _ops.router_update_bias(counts, bias, float(rate))


class Router(HandleOwner, nn.Module):
    """Fused top-k router. Options mirror the C++ RouterConfig (see docs/router.md):

    score "softmax" | "sigmoid"; softmax_after_topk (GPT-OSS); normalize_topk (renormalise the k
    probs); scaling_factor (routed_scaling_factor); expert_bias (a buffer `expert_bias` [E] fp32
    added to the scores for selection only); num_groups / topk_groups (group-limited top-k);
    aux_loss_coeff, seq_aux_loss_coeff + seq_length, z_loss_coeff; capacity_factor + drop_policy
    ("prob" | "position"); rounding ("none" | "down" | "up" | "nearest") + rounding_tile
    (+ rounding_candidates); output_form "topk" | "map"; bias_update_rate: with expert_bias, the
    rate update_bias() uses (selection counts are accumulated in `tokens_per_expert` every
    training forward).

    forward(logits [T, E] bf16/fp32) -> RouterOutput; differentiable in logits (through probs and
    the losses). T may change between calls (T <= max_tokens)."""

    _DESTROY = "router_destroy"

    def __init__(self, num_experts, topk, max_tokens, score="softmax", softmax_after_topk=False,
                 normalize_topk=False, scaling_factor=1.0, expert_bias=False, num_groups=1, topk_groups=1,
                 aux_loss_coeff=0.0, seq_aux_loss_coeff=0.0, seq_length=0, z_loss_coeff=0.0, capacity_factor=0.0,
                 drop_policy="prob", rounding="none", rounding_tile=128, rounding_candidates=0,
                 output_form="topk", bias_update_rate=1e-3):
        super().__init__()
        if output_form not in ("topk", "map"):
            raise ValueError(f"argument 'output_form': expected topk or map, got {output_form}")
        self.num_experts, self.topk, self.max_tokens = num_experts, topk, max_tokens
        self.map_output = output_form == "map"
        self.seq_aux = seq_aux_loss_coeff != 0.0
        self.seq_length = seq_length
        self.bias_update_rate = bias_update_rate
        self._make_handle("router_create", num_experts, topk, max_tokens, score, softmax_after_topk, normalize_topk,
                          float(scaling_factor), expert_bias, num_groups, topk_groups,
                          float(aux_loss_coeff), float(seq_aux_loss_coeff), seq_length,
                          float(z_loss_coeff), float(capacity_factor), drop_policy, rounding,
                          rounding_tile, rounding_candidates, self.map_output)
        self.width = _ops.router_selection_width(self.handle)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64))
        else:
            self.expert_bias = None
            self.tokens_per_expert = None

    def sequences(self, T):
        return T // self.seq_length if self.seq_aux else 0

    def forward(self, logits):
        routing, probs, counts, sel_counts, losses = _RouterFn.apply(self, logits, self.expert_bias)
        if self.tokens_per_expert is not None and self.training:
            self.tokens_per_expert += sel_counts
        idx, rmap = (None, routing) if self.map_output else (routing, None)
        return RouterOutput(idx, rmap, probs, counts, sel_counts, *losses.unbind(0))

    @torch.no_grad()
    def update_bias(self):
        """Aux-loss-free balancing step: expert_bias += rate * sign(mean - tokens_per_expert), then the
        accumulated counts are reset. Call once per optimizer step (after all micro-batches)."""
        if self.expert_bias is None:
            raise RuntimeError("Router.update_bias: the router was built without expert_bias")
        update_expert_bias(self.tokens_per_expert, self.expert_bias, self.bias_update_rate)
        self.tokens_per_expert.zero_()

    def check_errors(self):
        """Raises ValueError if a non-finite logit or bias was seen since the last check (those rows
        were routed nowhere). Synchronises: call outside graphs."""
        _ops.router_check_errors(self.handle)

    # ---- presets: the routing of each Hugging Face family ----

    @classmethod
    def mixtral(cls, num_experts=8, topk=2, max_tokens=16384, **kw):
        """softmax over E, top-k, renormalised (MixtralSparseMoeBlock)."""
        return cls(num_experts, topk, max_tokens, normalize_topk=True, **kw)

    @classmethod
    def qwen3(cls, num_experts=128, topk=8, max_tokens=16384, norm_topk_prob=True, **kw):
        """softmax over E, top-k, renormalised when norm_topk_prob (Qwen2/Qwen3-MoE)."""
        return cls(num_experts, topk, max_tokens, normalize_topk=norm_topk_prob, **kw)

    @classmethod
    def olmoe(cls, num_experts=64, topk=8, max_tokens=16384, norm_topk_prob=False, **kw):
        """softmax over E, top-k, not renormalised by default (OLMoE norm_topk_prob = False)."""
        return cls(num_experts, topk, max_tokens, normalize_topk=norm_topk_prob, **kw)

    @classmethod
    def gpt_oss(cls, num_experts=32, topk=4, max_tokens=16384, **kw):
        """top-k of the logits, softmax over the k chosen (GptOssTopKRouter)."""
        return cls(num_experts, topk, max_tokens, softmax_after_topk=True, **kw)

    @classmethod
    def deepseek_v3(cls, num_experts=256, topk=8, max_tokens=16384, n_group=8, topk_group=4,
                    routed_scaling_factor=2.5, norm_topk_prob=True, **kw):
        """sigmoid, e_score_correction_bias for selection, group-limited top-k (sum of each group's
        top-2), renormalised, scaled by routed_scaling_factor (DeepseekV3MoE)."""
        return cls(num_experts, topk, max_tokens, score="sigmoid", normalize_topk=norm_topk_prob,
                   scaling_factor=routed_scaling_factor, expert_bias=True, num_groups=n_group,
                   topk_groups=topk_group, **kw)
