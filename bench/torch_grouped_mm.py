#!/usr/bin/env python3
"""torch._grouped_mm on the groups of bench_grouped_gemm, side by side with our figures.

    build-gpu/bench/bench_grouped_gemm --groups-json groups.json --json ours.json
    python3 bench/torch_grouped_mm.py groups.json --ours ours.json [--out torch.json]

For every (shape, routing, fc) of groups.json it times, on the same padded group sizes and the same
FLOP convention (2 * T*k * N * K, padding rows not counted):
  fprop  Y  = X  W^T : _grouped_mm(x [R, K], w.transpose(-2, -1) [E, K, N], offs)
  dgrad  dX = dY W   : _grouped_mm(dy [R, N], w [E, N, K], offs)
  wgrad  dW = dY^T X : _grouped_mm(dy.t() [N, R], x [R, K], offs) -> [E, N, K]
each interleaved with torch's dense matmul (cuBLAS) of the same total size, exactly as
bench_grouped_gemm times ours beside cuBLAS: warm-up, then rounds of one >= ~4 ms batch per
candidate in rotating order, median per-launch time. With --ours it prints the side-by-side table:
ratio = ours / torch, and ratio_n = (ours / cuBLAS in our process) / (torch / cuBLAS in this one),
which cancels clock drift between the two processes.
"""
import argparse
import json
import statistics

import torch


def interleaved_ms(fns, rounds, batch_ms=4.0, warmup_ms=60.0):
    """Median per-launch milliseconds of each function, measured in interleaved rounds."""
    def time_batch(fn, b):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(b):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / b

    batch = []
    for fn in fns:
        time_batch(fn, 2)
        batch.append(max(1, min(50, round(batch_ms / max(time_batch(fn, 2), 1e-3)))))
    spent = 0.0
    while spent < warmup_ms:
        for fn, b in zip(fns, batch):
            spent += time_batch(fn, b) * b
    samples = [[] for _ in fns]
    for r in range(rounds):
        for j in range(len(fns)):
            i = (j + r) % len(fns)
            samples[i].append(time_batch(fns[i], batch[i]))
    return [sorted(s)[len(s) // 2] for s in samples]


def bench_groups(entry, rounds):
    E, H, F = entry["E"], entry["H"], entry["F"]
    sizes = torch.tensor(entry["sizes"], dtype=torch.int64)
    offs = torch.cumsum(sizes, 0).to(torch.int32).cuda()
    R = int(sizes.sum())
    useful = entry["useful_rows"]
    out = []
    for fc in (1, 2):
        N, K = (2 * F, H) if fc == 1 else (H, F)
        gen = torch.Generator(device="cuda").manual_seed(fc)
        x = torch.rand(R, K, device="cuda", generator=gen).mul_(2).sub_(1).bfloat16()
        dy = torch.rand(R, N, device="cuda", generator=gen).mul_(2).sub_(1).bfloat16()
        w = torch.rand(E, N, K, device="cuda", generator=gen).mul_(2).sub_(1).bfloat16()
        w0 = w[0]
        flops = 2.0 * useful * N * K
        ops = {  # grouped, then the dense GEMM of the same total size
            "fprop": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), lambda: x @ w0.t()),
            "dgrad": (lambda: torch._grouped_mm(dy, w, offs=offs), lambda: dy @ w0),
            "wgrad": (lambda: torch._grouped_mm(dy.t(), x, offs=offs), lambda: dy.t() @ x),
        }
        for op, (grouped, dense) in ops.items():
            ms, dense_ms = interleaved_ms([grouped, dense], rounds)
            out.append({"shape": entry["shape"], "routing": entry["routing"], "fc": fc, "op": op, "N": N, "K": K,
                        "torch_ms": ms, "torch_tflops": flops / (ms * 1e-3) / 1e12,
                        "torch_dense_tflops": flops / (dense_ms * 1e-3) / 1e12})
        del x, dy, w, w0
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("groups", help="groups JSON written by bench_grouped_gemm --groups-json")
    ap.add_argument("--ours", help="our figures (bench_grouped_gemm --json) for the side-by-side table")
    ap.add_argument("--out", help="write torch figures to this JSON file")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    groups = json.load(open(args.groups))
    torch_rows = []
    for entry in groups:
        torch_rows += bench_groups(entry, args.rounds)
    if args.out:
        json.dump(torch_rows, open(args.out, "w"), indent=1)
    if not args.ours:
        for r in torch_rows:
            print(json.dumps(r))
        return

    ours = {(r["shape"], r["routing"], r["fc"], r["op"]): r for r in json.load(open(args.ours))}
    print("TFLOP/s = 2*T*k*N*K / median time; targets: >= 1.05x torch everywhere, >= 700 where T*k/E >= 1024")
    print("ratio = ours/torch; ratio_n = (ours/our cuBLAS) / (torch/torch's cuBLAS), free of drift between processes")
    hdr = (f"{'shape':18} {'routing':8} {'fc':3} {'op':6} {'N':>6} {'K':>6} {'ours':>7} {'graph':>7} "
           f"{'torch':>7} {'ratio':>6} {'ratio_n':>7} {'cublas':>7} {'t_cublas':>8}  gap to targets")
    print(hdr)
    print("-" * len(hdr))
    ratios, ratios_n = [], []
    for t in torch_rows:
        o = ours.get((t["shape"], t["routing"], t["fc"], t["op"]))
        if o is None:
            continue
        ratio = o["ours_tflops"] / t["torch_tflops"]
        cub, tcub = o.get("cublas_tflops", 0.0), t["torch_dense_tflops"]
        ratio_n = (o["ours_tflops"] / cub) / (t["torch_tflops"] / tcub) if cub and tcub else float("nan")
        ratios.append(ratio)
        ratios_n.append(ratio_n)
        entry = next(g for g in groups if g["shape"] == t["shape"] and g["routing"] == t["routing"])
        per_expert = entry["T"] * entry["k"] / entry["E"]
        gaps = []
        if min(ratio, ratio_n) < 1.05:
            gaps.append(f"ratio {min(ratio, ratio_n):.3f} < 1.05")
        if per_expert >= 1024 and o["ours_tflops"] < 700:
            gaps.append(f"{700 - o['ours_tflops']:.0f} below 700")
        print(f"{t['shape']:18} {t['routing']:8} fc{t['fc']} {t['op']:6} {t['N']:6d} {t['K']:6d} "
              f"{o['ours_tflops']:7.1f} {o['ours_graph_tflops']:7.1f} {t['torch_tflops']:7.1f} {ratio:6.3f} "
              f"{ratio_n:7.3f} {cub:7.1f} {tcub:8.1f}  {'; '.join(gaps) if gaps else 'met'}")
    if ratios:
        print(f"ratio   ours/torch: min {min(ratios):.3f}  median {statistics.median(ratios):.3f}  max {max(ratios):.3f}")
        print(f"ratio_n ours/torch: min {min(ratios_n):.3f}  median {statistics.median(ratios_n):.3f}  "
              f"max {max(ratios_n):.3f}")


if __name__ == "__main__":
    main()
