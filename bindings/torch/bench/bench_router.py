"""Fused router (moe_engine.Router) against the PyTorch composition it replaces, in one process on
one GPU: forward and forward + backward, CUDA-event medians, per routing variant; "x" is the
speedup (PyTorch time / fused time). The variants are the Hugging Face presets at their own sizes,
then softmax + top-k + renormalise (qwen3's routing) over E in {64, 128, 256} and k in {2, 8}.
The PyTorch side does what the fused forward returns: scores, top-k, gather, renormalise, and the
per-expert token counts (a scatter-add of ones).

Eager calls mostly time the host at these sizes (Python, autograd and the launches of either side);
`--graph` captures each side's call (forward, or forward + backward) in a CUDA graph and times its
replays, which is the GPU work alone -- how a training step captured in graphs runs it.

    python3 bindings/torch/bench/bench_router.py [--tokens 16384 32768 65536] [--repeats 50] [--dtype bf16 fp32]
                                                 [--graph]
"""
import argparse
import math

import torch

from moe_engine import Router

try:
    from cuda_graphs import graphed
except ImportError:  # run from another directory
    from bench.cuda_graphs import graphed


def torch_route(z, k, kind, bias=None):
    """The routing of each preset as plain PyTorch ops (the composition the fused router replaces):
    indices, probs and the per-expert counts (what the fused forward also returns)."""
    i, p = torch_topk(z, k, kind, bias)
    counts = torch.zeros(z.shape[1], device=i.device, dtype=torch.int32).scatter_add_(
        0, i.flatten().long(), torch.ones(i.numel(), device=i.device, dtype=torch.int32))
    return i, p, counts


def torch_topk(z, k, kind, bias=None):
    if kind == "gpt_oss":
        v, i = torch.topk(z.float(), k, -1)
        return i.int(), torch.softmax(v, -1)
    if kind == "deepseek":
        s = torch.sigmoid(z.float())
        T, E = z.shape
        c = s + bias
        g = c.view(T, 8, E // 8).topk(2, -1)[0].sum(-1)
        keep = torch.zeros_like(g).scatter_(1, torch.topk(g, 4, -1)[1], 1.0)
        c = c.masked_fill(~keep.unsqueeze(-1).expand(T, 8, E // 8).reshape(T, E).bool(), float("-inf"))
        i = torch.topk(c, k, -1)[1]
        p = s.gather(1, i)
        return i.int(), p / p.sum(-1, keepdim=True) * 2.5
    s = torch.softmax(z.float(), -1)
    p, i = torch.topk(s, k, -1)
    if kind in ("mixtral", "qwen3"):
        p = p / p.sum(-1, keepdim=True)
    return i.int(), p


def median_ms(fn, repeats):
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[16384, 32768, 65536])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--dtype", nargs="*", default=["bf16"], choices=["bf16", "fp32"])
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays of each side's call")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "(CUDA graph replays)" if args.graph else "(eager)")
    print(f"{'variant':10} {'type':4} {'T':>6} {'E':>4} {'k':>2} {'ours fwd us':>12} {'torch fwd us':>13} {'x':>6} "
          f"{'ours f+b us':>12} {'torch f+b us':>13} {'x':>6}")
    variants = [("mixtral", 8, 2), ("qwen3", 128, 8), ("olmoe", 64, 8), ("gpt_oss", 128, 4), ("deepseek", 256, 8)]
    variants += [("qwen3", E, k) for E in (64, 128, 256) for k in (2, 8) if (E, k) != (128, 8)]
    speedups_f, speedups_fb = [], []
    presets = {"mixtral": Router.mixtral, "qwen3": Router.qwen3, "olmoe": Router.olmoe, "gpt_oss": Router.gpt_oss,
               "deepseek": Router.deepseek_v3}
    for dtype, T, (kind, E, k) in [(d, T, v) for d in args.dtype for T in args.tokens for v in variants]:
        router = presets[kind](E, k, T).cuda()
        z = torch.randn(T, E, device="cuda", dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                        requires_grad=True)
        bias = router.expert_bias if kind == "deepseek" else None
        dp = torch.randn(T, k, device="cuda")

        def ours_f():
            with torch.no_grad():
                router(z)

        def torch_f():
            with torch.no_grad():
                torch_route(z, k, kind, bias)

        def ours_fb():
            (router(z).probs * dp).sum().backward()

        def torch_fb():
            (torch_route(z, k, kind, bias)[1] * dp).sum().backward()

        fns = [ours_f, torch_f, ours_fb, torch_fb]
        if args.graph:
            fns = [graphed(f) for f in fns]
        of, tf, ofb, tfb = (median_ms(f, args.repeats) * 1e3 for f in fns)
        print(f"{kind:10} {dtype:4} {T:6d} {E:4d} {k:2d} {of:12.1f} {tf:13.1f} {tf / of:6.2f} "
              f"{ofb:12.1f} {tfb:13.1f} {tfb / ofb:6.2f}", flush=True)
        speedups_f.append(tf / of)
        speedups_fb.append(tfb / ofb)
    if speedups_f:
        gm = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))
        print(f"geometric mean speedup: forward {gm(speedups_f):.2f}x, forward + backward {gm(speedups_fb):.2f}x")


if __name__ == "__main__":
    main()
