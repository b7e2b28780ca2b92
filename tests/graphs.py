"""CUDA-graph capture for the GPU tests: one call warmed up outside the capture, then captured."""

from __future__ import annotations

import torch


def captured(fn):
    """Run ``fn()`` once on a side stream (compiles and warms up outside the capture, as CUDA graphs
    require), then capture one call of it: (graph, the warm-up call's result, the captured call's)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, warm, static
