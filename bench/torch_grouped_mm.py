#!/usr/bin/env python3
"""torch._grouped_mm on the groups of bench_grouped_gemm, side by side with our figures.

    build-gpu/bench/bench_grouped_gemm --groups-json groups.json --json ours.json
    python3 bench/torch_grouped_mm.py groups.json --ours ours.json [--out torch.json]

For every (shape, routing, fc) of groups.json it times, on the same padded group sizes and the same
FLOP convention (2 * T*k * N * K, padding rows not counted):
  fprop  Y  = X  W^T : _grouped_mm(x [R, K], w.transpose(-2, -1) [E, K, N], offs)
  dgrad  dX = dY W   : _grouped_mm(dy [R, N], w [E, N, K], offs)
  wgrad  dW = dY^T X : _grouped_mm(dy.t() [N, R], x [R, K], offs) -> [E, N, K]
CUDA events around each call after warm-up, median of the repeats. With --ours it prints the table
ours / torch / ratio / cuBLAS dense and the gap to the targets of BENCHMARKS.md.
"""
import argparse
import json
import statistics

import torch


def time_ms(fn, warmup=3, repeats=15):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), min(times), max(times)


def bench_groups(entry, repeats):
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
        flops = 2.0 * useful * N * K
        ops = {
            "fprop": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
            "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
            "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
        }
        for op, fn in ops.items():
            med, lo, hi = time_ms(fn, repeats=repeats)
            out.append({"shape": entry["shape"], "routing": entry["routing"], "fc": fc, "op": op, "N": N, "K": K,
                        "torch_ms": med, "torch_min_ms": lo, "torch_max_ms": hi,
                        "torch_tflops": flops / (med * 1e-3) / 1e12})
        del x, dy, w
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("groups", help="groups JSON written by bench_grouped_gemm --groups-json")
    ap.add_argument("--ours", help="our figures (bench_grouped_gemm --json) for the side-by-side table")
    ap.add_argument("--out", help="write torch figures to this JSON file")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    groups = json.load(open(args.groups))
    torch_rows = []
    for entry in groups:
        torch_rows += bench_groups(entry, args.repeats)
    if args.out:
        json.dump(torch_rows, open(args.out, "w"), indent=1)
    if not args.ours:
        for r in torch_rows:
            print(json.dumps(r))
        return

    ours = {(r["shape"], r["routing"], r["fc"], r["op"]): r for r in json.load(open(args.ours))}
    print("TFLOP/s = 2*T*k*N*K / median time; targets: >= 1.05x torch everywhere, >= 700 where T*k/E >= 1024")
    hdr = (f"{'shape':18} {'routing':8} {'fc':3} {'op':6} {'N':>6} {'K':>6} {'ours':>7} {'graph':>7} "
           f"{'torch':>7} {'ratio':>6} {'cublas':>7} {'ours/cub':>8}  gap to targets")
    print(hdr)
    print("-" * len(hdr))
    ratios = []
    for t in torch_rows:
        o = ours.get((t["shape"], t["routing"], t["fc"], t["op"]))
        if o is None:
            continue
        ratio = o["ours_tflops"] / t["torch_tflops"]
        ratios.append(ratio)
        entry = next(g for g in groups if g["shape"] == t["shape"] and g["routing"] == t["routing"])
        per_expert = entry["T"] * entry["k"] / entry["E"]
        gaps = []
        if ratio < 1.05:
            gaps.append(f"ratio {ratio:.3f} < 1.05")
        if per_expert >= 1024 and o["ours_tflops"] < 700:
            gaps.append(f"{700 - o['ours_tflops']:.0f} TFLOP/s below 700")
        cub = o.get("cublas_tflops", 0.0)
        print(f"{t['shape']:18} {t['routing']:8} fc{t['fc']} {t['op']:6} {t['N']:6d} {t['K']:6d} "
              f"{o['ours_tflops']:7.1f} {o['ours_graph_tflops']:7.1f} {t['torch_tflops']:7.1f} {ratio:6.3f} "
              f"{cub:7.1f} {o['ours_tflops'] / cub if cub else 0:8.3f}  {'; '.join(gaps) if gaps else 'met'}")
    if ratios:
        print(f"ratio ours/torch: min {min(ratios):.3f}  median {statistics.median(ratios):.3f}  max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
