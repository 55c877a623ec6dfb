"""Side by side in one process: the plain PyTorch MoE expert pipeline (stable argsort permute,
torch._grouped_mm, SwiGLU x prob, index_add_ combine), moe_engine.GroupedMLP and -- whenever
`sonicmoe` imports -- SonicMoE (timed by its own method, sonicmoe_side.py), on the same tokens and
routing (SonicMoE's router's when it is there): forward and forward+backward, eager and
CUDA-graph captured, on the named shapes of docs/shapes.md, with balanced routing or (--skew S) a
Zipf-like skewed one. Ours and SonicMoE are timed in
alternating rounds (--rounds, default 4; every other round in reverse order) and the medians over
the rounds are reported; ours is timed by its own method (medians of CUDA-event-timed calls back to back) and by SonicMoE's too.
In the same rounds, the layer's six products as dense cuBLAS GEMMs of the same sizes (dense_gemms):
how fast any layer could be whose GEMMs ran at cuBLAS's dense rate and whose other passes were free.
SonicMoE's timed layer includes its router (the gate GEMM, softmax top-k and their backward); beside
it, ours is also timed as the same whole block (moe_engine.MoELayer: the gate with SonicMoE's gate
weights, the fused router, the experts), the like-for-like figure ("block"). --alt-gemm-configs
"op=name,..." times, in the same rounds, a second GroupedMLP with the same weights whose grouped GEMMs
run those configurations (MOE_ENGINE_GEMM_CONFIGS, docs/gemm.md; e.g. the rows GEMM beside the
heuristic's CUTLASS kernels): the "alt" figures.

usage: python3 bindings/torch/bench/compare_with_pytorch.py [SHAPE ...] [--rounds N] [--token-chunks N] [--skew S]
       [--alt-gemm-configs CONFIGS] [--png chart.png]      (no names: all shapes)"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

from moe_engine import GroupedMLP, MoELayer

try:
    from cuda_graphs import graphed
    from sonicmoe_side import AVAILABLE as SONIC, SonicSide, time_like_sonic
except ImportError:  # run from another directory
    from bench.cuda_graphs import graphed
    from bench.sonicmoe_side import AVAILABLE as SONIC, SonicSide, time_like_sonic

SHAPES = {  # name: (T, H, F, E, k)
    "sonic-7b-fine": (24576, 1536, 256, 128, 8), "sonic-7b-coarse": (24576, 1536, 1024, 32, 2),
    "sonic-30b-fine": (32768, 4096, 512, 128, 8), "sonic-30b-coarse": (32768, 4096, 1024, 64, 4),
    "sonic-120b-coarse": (32768, 4096, 2048, 64, 4), "qwen3-30b-a3b-ep8": (16384, 2048, 768, 16, 8),
    "deepseek-v3-ep32": (8192, 7168, 2048, 8, 8), "mixtral-8x7b": (8192, 4096, 14336, 8, 2),
    "olmoe-1b-7b": (16384, 2048, 1024, 64, 8),
}


def torch_moe(x, idx, probs, w1, w2):
    E = w1.shape[0]
    k = idx.shape[1]
    flat = idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    tok = order // k
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x.index_select(0, tok), w1.transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, dim=-1)
    a = (F.silu(g) * u) * probs.reshape(-1)[order].unsqueeze(-1).to(h.dtype)
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    return torch.zeros_like(x).index_add_(0, tok, y)


def dense_gemms(T, H, Fd, k):
    """The layer's six products as dense cuBLAS GEMMs (torch.mm, bf16 in and out, fp32 accumulation)
    over all T*k rows at once: fc1 (H -> 2F, gate and linear halves) and fc2 (F -> H) forward, then
    their input and weight gradients; 6*T*k*H*F FLOPs forward and 12*T*k*H*F backward, the layer's own
    count. Nothing else: no gather or permute, no activation, no combine, no padding, and one
    reduction over every row where the layer's weight gradients reduce each expert's rows apart. A
    layer whose GEMMs ran at cuBLAS's dense rate and whose every other pass cost nothing would take
    this long: the speed of light the layer ratios are read against. Returns (forward,
    forward_backward), each writing into buffers allocated here."""
    R = T * k
    gen = torch.Generator(device="cuda").manual_seed(1)
    t = lambda *size: (torch.randn(*size, device="cuda", generator=gen) * 0.1).bfloat16()
    x_rows, w1, w2, dy_rows = t(R, H), t(H, 2 * Fd), t(Fd, H), t(R, H)
    act, dh = t(R, Fd), t(R, 2 * Fd)
    h, y, dact, dx_rows = t(R, 2 * Fd), t(R, H), t(R, Fd), t(R, H)
    dw1, dw2 = t(H, 2 * Fd), t(Fd, H)

    def forward():
        torch.mm(x_rows, w1, out=h)
        torch.mm(act, w2, out=y)

    def forward_backward():
        forward()
        torch.mm(dy_rows, w2.t(), out=dact)   # fc2 dgrad
        torch.mm(act.t(), dy_rows, out=dw2)   # fc2 wgrad
        torch.mm(dh, w1.t(), out=dx_rows)     # fc1 dgrad
        torch.mm(x_rows.t(), dh, out=dw1)     # fc1 wgrad
    return forward, forward_backward


def median(values):
    return sorted(values)[len(values) // 2]


def median_ms(fn, iters=10, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return median(times)


def skew_offsets(E, skew):
    """Expert e's logit offset for skewed routing, -skew * log(1 + e): the popularity of `moe-engine bench
    --skew` (src/reference/routing_gen.h), a few experts receiving many more tokens than the rest."""
    return -skew * torch.log1p(torch.arange(E, device="cuda", dtype=torch.float32))


def whole_block(sonic, T, H, Fd, E, k, token_chunks, x, dy, res):
    """Ours as the same whole block SonicMoE's timed layer is -- gate (its gate weights, so the same
    logits up to rounding), softmax top-k router, experts: MoELayer(router="softmax") -- as
    ([(key, step)], block) for the forward and forward+backward timed by SonicMoE's method; ([], None)
    (with res["ours_block_error"]) where it cannot be built or captured. The caller holds `block` as
    long as it replays the steps: the graphs run in its parameters and its ops' workspaces, which
    go with it."""
    try:
        block = MoELayer(H, Fd, E, k, max_tokens=T, router="softmax", token_chunks=token_chunks)
        with torch.no_grad():
            block.gate.weight.copy_(sonic.moe.router.weight)

        def block_forward():
            with torch.no_grad():
                block(x)

        def block_step():
            x.grad = None
            block.zero_grad(set_to_none=True)
            block(x)[0].backward(dy)

        steps = [("ours_block_fwd_sonic_method_ms", graphed(block_forward)),
                 ("ours_block_fwd_bwd_sonic_method_ms", graphed(block_step))]
        x.grad = None
        block.zero_grad(set_to_none=True)
        return steps, block
    except Exception as ex:  # report, don't hide
        res["ours_block_error"] = str(ex)[:160]
        return [], None


def module_with_gemm_configs(configs, make):
    """make() with every GroupedGemm it builds forcing `configs` (read at construction)."""
    old = os.environ.get("MOE_ENGINE_GEMM_CONFIGS")
    os.environ["MOE_ENGINE_GEMM_CONFIGS"] = configs
    try:
        return make()
    finally:
        if old is None:
            del os.environ["MOE_ENGINE_GEMM_CONFIGS"]
        else:
            os.environ["MOE_ENGINE_GEMM_CONFIGS"] = old


def measure(name, rounds=4, token_chunks=1, skew=0.0, alt_gemm_configs=None):
    T, H, Fd, E, k = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(T, H, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
    logits = torch.randn(T, E, device="cuda", generator=gen)
    if skew > 0:
        logits += skew_offsets(E, skew)
    probs, idx = torch.topk(torch.softmax(logits, -1), k)
    idx, probs = idx.to(torch.int32), probs.float()
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    sonic = SonicSide(T, H, Fd, E, k, x, dy) if SONIC else None
    if sonic is not None and skew > 0:
        sonic.skew_router(skew)
    bench_idx, bench_probs = idx, probs
    if sonic is not None:  # the same routing for every side
        idx, probs = sonic.routing()
    res = {"shape": name, "skew": skew}
    # Rows of the busiest expert over the mean: how uneven the routing each side is timed on is.
    for label, i in (("sonic", idx if sonic is not None else None), ("bench", bench_idx)):
        if i is not None:
            rows = torch.bincount(i.long().flatten(), minlength=E).float()
            res[f"{label}_routing_max_over_mean"] = (rows.max() / rows.mean()).item()
    mod = GroupedMLP(H, Fd, E, k, max_tokens=T, token_chunks=token_chunks)
    alt = None
    if alt_gemm_configs:
        alt = module_with_gemm_configs(alt_gemm_configs,
                                       lambda: GroupedMLP(H, Fd, E, k, max_tokens=T, token_chunks=token_chunks))
        alt.load_state_dict(mod.state_dict())
    w1 = mod.fc1.weight.detach().clone().requires_grad_()
    w2 = mod.fc2.weight.detach().clone().requires_grad_()
    flops = 18 * T * k * H * Fd

    # Every step starts from gradients set to None (as SonicMoE's method does), so no side pays an
    # extra pass accumulating into the previous step's .grad.
    def torch_step():
        x.grad = w1.grad = w2.grad = None
        torch_moe(x, idx, probs, w1, w2).backward(dy)

    def ours_step():
        x.grad = None
        mod.zero_grad(set_to_none=True)
        mod(x, idx, probs).backward(dy)

    def ours_forward(routing=None):
        i, p = routing or (idx, probs)
        with torch.no_grad():
            mod(x, i, p)

    try:
        fwd_graph = graphed(ours_forward)
    except Exception as ex:  # report, don't hide
        fwd_graph = None
        res["ours_fwd_graph_error"] = str(ex)[:160]
    block_steps, block = [], None
    if sonic is not None:
        # Ours again on the routing `moe-engine bench` uses (softmax over standard-normal logits,
        # top-k), in the same process: separates the effect of SonicMoE's routing (its router on
        # these tokens) from the module's own cost.
        res["ours_fwd_graph_ms_bench_routing"] = median_ms(graphed(lambda: ours_forward((bench_idx, bench_probs))))
        res.update(sonic.prepare())
        x.grad = None
        # block: held until the rounds end (its graphs replay into its memory)
        block_steps, block = whole_block(sonic, T, H, Fd, E, k, token_chunks, x, dy, res)

    def clear_grads():
        x.grad = w1.grad = w2.grad = None
        mod.zero_grad(set_to_none=True)
        if alt is not None:
            alt.zero_grad(set_to_none=True)

    # Peak extra memory of one eager step, then the step captured.
    def peak_extra_gib(step):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        gib = (torch.cuda.max_memory_allocated() - base) / 2**30
        clear_grads()
        return gib

    def graph_of(label, step):
        try:
            return graphed(step)
        except Exception as ex:  # report, don't hide
            res[f"{label}_graph_error"] = str(ex)[:160]
            return None
        finally:
            clear_grads()

    res["ours_extra_gib"] = peak_extra_gib(ours_step)
    step_graph = graph_of("ours", ours_step)
    alt_steps = []
    if alt is not None:
        def alt_forward():
            with torch.no_grad():
                alt(x, idx, probs)

        def alt_step():
            x.grad = None
            alt.zero_grad(set_to_none=True)
            alt(x, idx, probs).backward(dy)
        with torch.no_grad():  # the same outputs up to the GEMMs' rounding, or the figures mean nothing
            ref = mod(x, idx, probs).float()
            res["alt_rel_err"] = ((alt(x, idx, probs).float() - ref).norm() / ref.norm()).item()
        alt_steps = [(key, g) for key, g in (("alt_fwd", graph_of("alt_fwd", alt_forward)),
                                             ("alt_fwd_bwd", graph_of("alt", alt_step))) if g is not None]

    # Ours and SonicMoE in alternating rounds, medians over the rounds: the clocks at the 700 W limit
    # drift with the GPU's temperature and the load just before, and a single sample of either side
    # moved the ratio by up to 8% between runs. A round times ours' forward, SonicMoE's forward and
    # forward+backward, then ours' forward+backward; every other round runs the same steps in the
    # reverse order, so that each side's forward follows a heavy step as often as a light one.
    samples = {}

    def sample(key, ms):
        samples.setdefault(key, []).append(ms)

    # The alt layer's step right after ours' same step, so that the reversed rounds put each of the
    # two first as often (apart by a few steps, their ratio moved with the rounds' order by 3-4%).
    alt_graphs = dict(alt_steps)

    def then_alt(key, suffix, timer):
        if key in alt_graphs:
            steps.append(lambda: sample(key + suffix, timer(alt_graphs[key])))

    steps = [lambda: sample("ours_fwd_eager_ms", median_ms(ours_forward))]
    if fwd_graph is not None:
        steps.append(lambda: sample("ours_fwd_graph_ms", median_ms(fwd_graph)))
    then_alt("alt_fwd", "_graph_ms", median_ms)
    if sonic is not None:
        # Ours by SonicMoE's method as well (its do_bench flushes the L2 before every call, and the
        # flush's pauses let the clocks recover at the power limit).
        steps.append(lambda: sample("ours_fwd_sonic_method_ms", time_like_sonic(fwd_graph or ours_forward)))
        then_alt("alt_fwd", "_sonic_method_ms", time_like_sonic)

        def sonic_step(key, fn):
            x.grad = None  # ours' last step left it set
            sample(key, fn())
        steps.append(lambda: sonic_step("sonic_fwd_ms", sonic.time_fwd))
        steps.append(lambda: sonic_step("sonic_fwd_bwd_ms", sonic.time_fwd_bwd))
        steps.append(lambda: sample("ours_fwd_bwd_sonic_method_ms", time_like_sonic(step_graph or ours_step)))
        then_alt("alt_fwd_bwd", "_sonic_method_ms", time_like_sonic)
        for key, fn in block_steps:
            steps.append(lambda key=key, fn=fn: sample(key, time_like_sonic(fn)))
    steps.append(lambda: sample("ours_eager_ms", median_ms(ours_step)))
    if step_graph is not None:
        steps.append(lambda: sample("ours_graph_ms", median_ms(step_graph)))
    then_alt("alt_fwd_bwd", "_graph_ms", median_ms)
    dense = dense_gemms(T, H, Fd, k)  # held until the rounds end: the graphs replay into its buffers
    dense_fwd, dense_fwd_bwd = (graphed(f) for f in dense)
    steps.append(lambda: sample("dense_fwd_ms", median_ms(dense_fwd)))
    steps.append(lambda: sample("dense_fwd_bwd_ms", median_ms(dense_fwd_bwd)))
    if sonic is not None:
        steps.append(lambda: sample("dense_fwd_sonic_method_ms", time_like_sonic(dense_fwd)))
        steps.append(lambda: sample("dense_fwd_bwd_sonic_method_ms", time_like_sonic(dense_fwd_bwd)))
    for r in range(rounds):
        for step in (steps if r % 2 == 0 else reversed(steps)):
            step()
    clear_grads()
    del dense, dense_fwd, dense_fwd_bwd, block_steps, block
    for key, ms in samples.items():
        res[key] = median(ms)
        res[key + "_rounds"] = ms
    res.setdefault("ours_fwd_graph_ms", None)
    res.setdefault("ours_graph_ms", None)
    if sonic is not None:
        best_fwd = min(v for v in (res["ours_fwd_eager_ms"], res["ours_fwd_graph_ms"]) if v)
        res["fwd_vs_sonic"] = res["sonic_fwd_ms"] / best_fwd
        res["fwd_vs_sonic_same_method"] = res["sonic_fwd_ms"] / res["ours_fwd_sonic_method_ms"]
        # The most any layer could lead SonicMoE by with its GEMMs at cuBLAS's dense rate (same method).
        res["dense_fwd_vs_sonic"] = res["sonic_fwd_ms"] / res["dense_fwd_sonic_method_ms"]
        res["dense_fwd_bwd_vs_sonic"] = res["sonic_fwd_bwd_ms"] / res["dense_fwd_bwd_sonic_method_ms"]

    # The plain PyTorch baseline last: timed after the fast layers, its long run would lower their
    # clocks (ours ran 2.6-6.6% behind `moe-engine bench` on the large shapes when timed after it).
    res["torch_extra_gib"] = peak_extra_gib(torch_step)
    res["torch_eager_ms"] = median_ms(torch_step)
    torch_graph = graph_of("torch", torch_step)  # torch_step clears the gradients it finds
    res["torch_graph_ms"] = median_ms(torch_graph) if torch_graph is not None else None
    clear_grads()
    # The layer's own planned memory is allocated once outside PyTorch's allocator: count it too.
    res["ours_extra_gib"] += mod.workspace_bytes() / 2**30
    for label in ("torch", "ours"):
        for mode in ("eager", "graph"):
            ms = res.get(f"{label}_{mode}_ms")
            res[f"{label}_{mode}_tflops"] = flops / (ms * 1e-3) / 1e12 if ms else None
    res["dense_fwd_tflops"] = flops / 3 / (res["dense_fwd_ms"] * 1e-3) / 1e12
    res["dense_fwd_bwd_tflops"] = flops / (res["dense_fwd_bwd_ms"] * 1e-3) / 1e12
    best = lambda l: min(v for v in (res[f"{l}_eager_ms"], res.get(f"{l}_graph_ms")) if v)
    res["speedup"] = best("torch") / best("ours")
    if sonic is not None:
        res["fwd_bwd_vs_sonic"] = res["sonic_fwd_bwd_ms"] / best("ours")
        res["fwd_bwd_vs_sonic_same_method"] = res["sonic_fwd_bwd_ms"] / res["ours_fwd_bwd_sonic_method_ms"]
        if "ours_block_fwd_bwd_sonic_method_ms" in res:
            res["block_fwd_vs_sonic_same_method"] = res["sonic_fwd_ms"] / res["ours_block_fwd_sonic_method_ms"]
            res["block_fwd_bwd_vs_sonic_same_method"] = (res["sonic_fwd_bwd_ms"]
                                                         / res["ours_block_fwd_bwd_sonic_method_ms"])
        if "alt_fwd_bwd_sonic_method_ms" in res:
            res["alt_fwd_bwd_vs_sonic_same_method"] = res["sonic_fwd_bwd_ms"] / res["alt_fwd_bwd_sonic_method_ms"]
    if "alt_fwd_bwd_graph_ms" in res and res.get("ours_graph_ms"):
        res["alt_fwd_bwd_over_ours_graph"] = res["ours_graph_ms"] / res["alt_fwd_bwd_graph_ms"]
    del mod, alt
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*")
    ap.add_argument("--png")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of ours and SonicMoE, every other one in reverse order (medians reported)")
    ap.add_argument("--token-chunks", type=int, default=1, help="ours with fc2 + combine and the fc1 dgrad + dx sum "
                    "in this many pieces of tokens (GroupedMLP(token_chunks=N): less memory)")
    ap.add_argument("--alt-gemm-configs", help="also time ours with these grouped GEMM configurations, e.g. "
                    "fprop=rows_coop_128x256x64_c2x1,dgrad=rows_pong_64x256x64_c2x1 (MOE_ENGINE_GEMM_CONFIGS)")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="skewed routing: expert e's logit offset by -S * log(1 + e) (for SonicMoE through its "
                         "router's weights, at its logits' scale), as `moe-engine bench --skew`")
    args = ap.parse_args()
    if args.skew < 0:
        ap.error("--skew must be >= 0")
    names = args.shapes or list(SHAPES)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}: forward+backward, bf16, swiglu x prob, "
          + (f"skewed routing (--skew {args.skew:g})" if args.skew > 0 else "balanced routing"))
    print(f"{'shape':<18} {'torch ms':>9} {'TF/s':>6} {'GiB':>6} | {'ours ms':>9} {'TF/s':>6} {'GiB':>6} | {'ratio':>5}"
          " | dense cuBLAS fwd / fwd+bwd ms (TF/s)"
          + (" | sonic fwd / fwd+bwd ms, GiB, ours fwd / fwd+bwd speed-up (ours by our method; both by SonicMoE's)"
             if SONIC else ""))
    rows = []
    for n in names:
        r = measure(n, args.rounds, args.token_chunks, args.skew, args.alt_gemm_configs)
        rows.append(r)
        print(json.dumps(r), flush=True)
        t = r["torch_graph_ms"] or r["torch_eager_ms"]
        o = r["ours_graph_ms"] or r["ours_eager_ms"]
        print(f"{n:<18} {t:9.3f} {r['torch_graph_tflops'] or r['torch_eager_tflops']:6.0f} {r['torch_extra_gib']:6.2f} | "
              f"{o:9.3f} {r['ours_graph_tflops'] or r['ours_eager_tflops']:6.0f} {r['ours_extra_gib']:6.2f} | "
              f"{r['speedup']:5.2f} | {r['dense_fwd_ms']:.3f} / {r['dense_fwd_bwd_ms']:.3f} "
              f"({r['dense_fwd_tflops']:.0f} / {r['dense_fwd_bwd_tflops']:.0f})"
              + (f" | {r['sonic_fwd_ms']:.3f} / {r['sonic_fwd_bwd_ms']:.3f}, {r['sonic_extra_gib']:.2f}, "
                 f"{r['fwd_vs_sonic']:.2f}x / {r['fwd_bwd_vs_sonic']:.2f}x, both by its method "
                 f"{r['fwd_vs_sonic_same_method']:.2f}x / {r['fwd_bwd_vs_sonic_same_method']:.2f}x, "
                 f"SonicMoE over the dense GEMMs {r['dense_fwd_vs_sonic']:.2f}x / {r['dense_fwd_bwd_vs_sonic']:.2f}x"
                 + (f", ours as the whole block (gate + router + experts) {r['block_fwd_vs_sonic_same_method']:.2f}x / "
                    f"{r['block_fwd_bwd_vs_sonic_same_method']:.2f}x" if "block_fwd_bwd_vs_sonic_same_method" in r
                    else f", whole block: {r.get('ours_block_error', 'not timed')}") if SONIC else "")
              + (f" | alt GEMMs: fwd+bwd {r['alt_fwd_bwd_over_ours_graph']:.3f}x ours (graph)"
                 + (f", {r['alt_fwd_bwd_vs_sonic_same_method']:.2f}x SonicMoE" if "alt_fwd_bwd_vs_sonic_same_method" in r
                    else "") + f", rel err {r['alt_rel_err']:.1e}" if "alt_fwd_bwd_over_ours_graph" in r else ""),
              flush=True)
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 4))
        xs = range(len(rows))
        ax.bar([i - 0.2 for i in xs], [r["torch_graph_tflops"] or r["torch_eager_tflops"] for r in rows], 0.4, label="PyTorch")
        ax.bar([i + 0.2 for i in xs], [r["ours_graph_tflops"] or r["ours_eager_tflops"] for r in rows], 0.4, label="moe-engine")
        ax.set_xticks(list(xs), [r["shape"] for r in rows], rotation=30, ha="right")
        ax.set_ylabel("fwd+bwd TFLOP/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png)


if __name__ == "__main__":
    main()
