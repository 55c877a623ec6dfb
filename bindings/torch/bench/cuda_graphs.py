"""CUDA-graph capture for the benchmarks: a step captured once, timed by its replays."""
import torch


def graphed(step, warmup=3):
    """step captured in a CUDA graph after `warmup` calls on a side stream (as torch.cuda.graph
    asks); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay
