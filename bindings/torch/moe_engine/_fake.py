"""Fake (meta) implementations of the moe_engine operators: output shapes and dtypes only, so
torch.compile / FakeTensor tracing can run through them without a GPU kernel. Every size a fake
needs is an argument of its operator, except the state header counts, which the library reports."""
import torch

lib = "moe_engine::"


def _state(like, nbytes, headers):
    return (like.new_empty((nbytes,), dtype=torch.uint8),
            torch.empty((headers * _HEADER_BYTES,), dtype=torch.uint8, device="cpu"))


_HEADER_BYTES = 64  # one moe::StateHeader
# Headers of a layer state, an experts state and a dispatch plan, as the library defines them.
_MLP_HEADERS, _EXPERTS_HEADERS, _PLAN_HEADERS = torch.ops.moe_engine.state_headers()


@torch.library.register_fake(lib + "mlp_forward")
def _mlp_forward(handle, x, routing, probs, w1, b1, w2, b2, state_bytes):
    return (torch.empty_like(x), *_state(x, state_bytes, _MLP_HEADERS))


@torch.library.register_fake(lib + "mlp_backward")
def _mlp_backward(handle, state, header, x, dy, slots, gw1, gb1, gw2, gb2):  # x: None unless read again
    return torch.empty_like(dy), dy.new_empty((dy.shape[0], slots), dtype=torch.float32)


@torch.library.register_fake(lib + "mlp_backward_dw")
def _mlp_backward_dw(handle, state, header, x, gw1, gb1, gw2, gb2):
    return None


@torch.library.register_fake(lib + "experts_forward")
def _experts_forward(handle, x_perm, group_offsets, probs_perm, w1, b1, w2, b2, state_bytes):
    return (torch.empty_like(x_perm), *_state(x_perm, state_bytes, _EXPERTS_HEADERS))


@torch.library.register_fake(lib + "experts_backward")
def _experts_backward(handle, state, header, x_perm, group_offsets, probs_perm, dY, with_probs, gw1, gb1, gw2, gb2):
    return torch.empty_like(dY), dY.new_empty((dY.shape[0] if with_probs else 0,), dtype=torch.float32)


@torch.library.register_fake(lib + "experts_backward_dw")
def _experts_backward_dw(handle, state, header, x_perm, group_offsets, probs_perm, dY, gw1, gb1, gw2, gb2):
    return None


@torch.library.register_fake(lib + "dispatch_permute")
def _dispatch_permute(handle, x, routing, probs, rows, experts, plan_bytes):
    return (x.new_empty((rows, x.shape[1])), x.new_empty((rows,), dtype=torch.float32),
            x.new_empty((experts + 1,), dtype=torch.int32), x.new_empty((experts,), dtype=torch.int64),
            *_state(x, plan_bytes, _PLAN_HEADERS))


@torch.library.register_fake(lib + "dispatch_permute_backward")
def _dispatch_permute_backward(handle, plan, header, d_x_perm, d_probs_perm, tokens, slots):
    return (d_x_perm.new_empty((tokens, d_x_perm.shape[1])),
            d_x_perm.new_empty((tokens, slots), dtype=torch.float32))


@torch.library.register_fake(lib + "dispatch_unpermute")
def _dispatch_unpermute(handle, plan, header, Y, probs, tokens):
    return Y.new_empty((tokens, Y.shape[1]))


@torch.library.register_fake(lib + "dispatch_unpermute_backward")
def _dispatch_unpermute_backward(handle, plan, header, dy, Y, probs, slots):
    return dy.new_empty((Y.shape[0], dy.shape[1])), dy.new_empty((dy.shape[0], slots), dtype=torch.float32)


@torch.library.register_fake(lib + "grouped_mm")
def _grouped_mm(x, w, group_offsets):
    return x.new_empty((x.shape[0], w.shape[1]))


@torch.library.register_fake(lib + "grouped_mm_dgrad")
def _grouped_mm_dgrad(dy, w, group_offsets):
    return dy.new_empty((dy.shape[0], w.shape[2]))


@torch.library.register_fake(lib + "grouped_mm_wgrad")
def _grouped_mm_wgrad(dy, x, group_offsets):
    return dy.new_empty((group_offsets.shape[0] - 1, dy.shape[1], x.shape[1]))
