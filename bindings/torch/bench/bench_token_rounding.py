"""Token rounding's effect on the expert layer: the fused router (softmax over E, top-k, renormalised)
routes the same logits with rounding "none", "down" (each expert's count rounded down to a multiple
of 128: the lowest-scoring tokens of an expert are dropped) and "nearest" (SonicMoE's rule: to the
nearest multiple, adding the best-scoring unchosen candidates where it rounds up; map-form routing),
then the layer (GroupedMLP, swiglu x prob, graph-captured) runs forward + backward on each routing.

Rows: the expert rows the routing gives (T * k without rounding); partial tiles: experts whose count
is not a multiple of 128. Time per row (us per 1000 rows) separates the tile effect from the change
in work; "x" is the speed-up of the whole layer step over rounding "none".

    python3 bindings/torch/bench/bench_token_rounding.py [SHAPE ...]   (default: sonic-7b-fine qwen3-30b-a3b-ep8)
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_with_pytorch import SHAPES, graphed, median_ms  # noqa: E402

from moe_engine import GroupedMLP, Router  # noqa: E402

TILE = 128


def routed(T, E, k, logits, rounding):
    router = Router(E, k, T, normalize_topk=True, rounding=rounding, rounding_tile=TILE,
                    rounding_candidates=k if rounding in ("up", "nearest") else 0,
                    output_form="map" if rounding in ("up", "nearest") else "topk").cuda()
    with torch.no_grad():
        out = router(logits)
    routing = out.map if out.indices is None else out.indices
    return routing, out.probs.float(), out.counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["sonic-7b-fine", "qwen3-30b-a3b-ep8"])
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}: fused router + GroupedMLP forward+backward, graph-captured, "
          f"rounding tile {TILE}")
    print(f"{'shape':18} {'rounding':8} {'rows':>8} {'partial tiles':>13} {'fwd+bwd ms':>10} {'us/1k rows':>10} "
          f"{'x':>6}")
    for name in args.shapes:
        T, H, Fd, E, k = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(T, H, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
        logits = torch.randn(T, E, device="cuda", generator=gen)
        dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        topk_mod = GroupedMLP(H, Fd, E, k, max_tokens=T).cuda()
        # "nearest" rounds some experts up: at most TILE / 2 more rows each.
        map_mod = GroupedMLP(H, Fd, E, k, max_tokens=T, map_routing=True, row_bound=T * k + E * TILE).cuda()
        map_mod.load_state_dict(topk_mod.state_dict())
        base = None
        for rounding in ("none", "down", "nearest"):
            routing, probs, counts = routed(T, E, k, logits, rounding)
            mod = map_mod if routing.dtype == torch.bool else topk_mod

            def step():
                x.grad = None
                mod.zero_grad(set_to_none=True)
                mod(x, routing, probs).backward(dy)

            ms = median_ms(graphed(step))
            rows = int(counts.sum())
            partial = int((counts % TILE != 0).sum())
            base = base or ms
            print(f"{name:18} {rounding:8} {rows:8d} {partial:13d} {ms:10.3f} {ms * 1e6 / rows:10.3f} "
                  f"{base / ms:6.2f}", flush=True)


if __name__ == "__main__":
    main()
