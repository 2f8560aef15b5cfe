"""Which CUDA graphs an engine captures: decode steps (engine/cuda_graph.py) and prefill
passes (engine/prefill_graph.py)."""

from __future__ import annotations

from minfer.engine.cuda_graph import CudaGraphRunner
from minfer.engine.prefill_graph import MAX_REQUESTS, PrefillGraphRunner, prefill_graph_tokens


def capture_cuda_graphs(engine) -> None:
    """Capture the decode graphs (`--cuda-graph-max-bs`) and the prefill graphs
    (`--prefill-cuda-graph-max-tokens`) of a CUDA engine whose backend is Triton's."""
    cfg = engine.config
    if cfg.cuda_graph_max_bs > 0:
        engine.graphs = CudaGraphRunner(engine, min(cfg.cuda_graph_max_bs, engine.max_running_requests))
        engine.memory.graph_measured_bytes += engine.graphs.memory_bytes
    tokens = prefill_graph_tokens(engine)
    if tokens:
        runner = PrefillGraphRunner(engine, tokens, min(engine.max_running_requests, MAX_REQUESTS))
        engine.prefill_graphs = runner
        engine.memory.graph_measured_bytes += runner.memory_bytes
