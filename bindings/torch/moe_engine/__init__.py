"""moe-engine for PyTorch: CUDA-graph-safe MoE expert layer (dispatch, grouped GEMM, gated
activation x prob, combine, full backward) on Hopper GPUs.

    from moe_engine import GroupedMLP
    mlp = GroupedMLP(hidden_size=2048, ffn_hidden_size=768, num_experts=16, topk=8, max_tokens=16384)
    y = mlp(x, topk_indices, topk_probs)          # x bf16 [T, H], indices int32 [T, k], probs fp32 [T, k]

Operators live under torch.ops.moe_engine (registered by the compiled extension moe_engine._C) and
have fake implementations, so torch.compile can trace them."""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.moe_engine.*)
from . import _fake  # noqa: F401  (fake / meta implementations for torch.compile)
from .module import GroupedExperts, GroupedMLP
from .moe_layer import MoELayer
from .ops import DispatchPlan, Dispatcher, grouped_mm, grouped_mm_check_errors
from .router import Router, RouterOutput, update_expert_bias
from .state_dict import normalize_expert_keys

__all__ = ["GroupedMLP", "GroupedExperts", "Dispatcher", "DispatchPlan", "grouped_mm", "grouped_mm_check_errors",
           "normalize_expert_keys", "Router", "RouterOutput", "update_expert_bias", "MoELayer"]
