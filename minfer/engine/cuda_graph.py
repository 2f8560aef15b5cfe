"""CUDA graphs for decode steps (prefill passes: engine/prefill_graph.py).

A decode step of a small model is hundreds of short kernel launches; replaying a captured
graph issues them all at once. Graphs are captured for a ladder of batch sizes up to
`--cuda-graph-max-bs`; a batch runs in the smallest captured size that holds it, padded.
Padded rows read a reserved page-table row and write their K/V to the pool's scratch page,
so they never touch a real request's cache.

Without tensor parallelism the graph ends with the draw itself: the Gumbel-max of each row's
logits at its temperature, written to the token table where the next step reads its input
(kernels/sampling.py). A batch whose every request draws plainly (sample_step.draws_plainly:
no logprobs, penalties, bans, grammar or filters) takes those tokens and skips the sampler's
launches; any other batch samples the graph's logits as before, and that draw overwrites the
graph's in the token table (the launches run in stream order). MINFER_GRAPH_DRAW=off leaves
every draw to the sampler, for A/B runs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time

import torch

from minfer.attention.base import AttentionMetadata, ForwardContext
from minfer.core import Req
from minfer.engine.decode_inputs import OUT_LOC, SEQ_LENS, DecodeInputs, padding_columns
from minfer.engine.penalties import banned_tokens
from minfer.engine.sample_step import draws_plainly

log = logging.getLogger(__name__)


@contextlib.contextmanager
def capture_guarded():
    """Inference mode, and no garbage collection while graphs are captured: collecting an
    earlier engine's graphs calls cudaGraphExecDestroy, which is illegal while a stream
    captures and voids the capture (seen on an H200 when one process built several engines in
    turn)."""
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode():
            yield
    finally:
        if gc_was_enabled:
            gc.enable()


def capture_graphs(sizes: list[int], run, what: str) -> tuple[dict[int, torch.cuda.CUDAGraph], int]:
    """One graph of `run(size)` per size, in one memory pool, largest first (smaller ones reuse
    its memory); each run once outside its graph first (that compiles kernels and settles
    allocations). Logs the capture (`what`: the graphs, as the log line names them). Returns
    (graphs by size, device bytes the capture took)."""
    start = time.perf_counter()
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    with capture_guarded():
        for size in sorted(sizes, reverse=True):
            run(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                run(size)
            graphs[size] = graph
    torch.cuda.synchronize()
    memory_bytes = free_before - torch.cuda.mem_get_info()[0]
    seconds = time.perf_counter() - start
    log.info("captured %d %s in %.1f s using %.2f GiB", len(graphs), what, seconds, memory_bytes / (1 << 30))
    return graphs, memory_bytes


def release_graphs(graphs: dict[int, torch.cuda.CUDAGraph], device: torch.device) -> None:
    """Free every captured graph. Graphs holding NCCL collectives keep their communicator busy:
    NCCL's teardown waits until they are gone (see distributed/parallel.py)."""
    torch.cuda.synchronize(device)
    for graph in graphs.values():
        graph.reset()
    graphs.clear()


class GraphInputs:
    """The token buffers a captured pass reads: ids, positions, and the KV slot each token's
    K/V goes to (entries past the pass point at the pool's scratch slot)."""

    def __init__(self, size: int, scratch_slot: int, device: torch.device):
        self.scratch_slot = scratch_slot
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.out_loc = torch.full((size,), scratch_slot, dtype=torch.int64, device=device)

    def stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor, padded: int
    ) -> None:
        """Copy in a pass of n tokens that its graph runs padded to `padded` rows. The padding
        rows' K/V go to the scratch slot, never to a slot a real request owns (stale entries
        from an earlier, larger pass would be real slots)."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.out_loc[:n].copy_(out_loc)
        if padded > n:
            self.out_loc[n:padded].fill_(self.scratch_slot)


def graph_draw_enabled() -> bool:
    """MINFER_GRAPH_DRAW: "on" (the default) or "off" (see the module's docstring)."""
    mode = os.environ.get("MINFER_GRAPH_DRAW", "on")
    if mode not in ("on", "off"):
        raise ValueError(f"MINFER_GRAPH_DRAW={mode!r}: expected on or off")
    return mode == "on"


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(self, engine, max_bs: int):
        self.engine = engine
        self.device = engine.device
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        dev = self.device
        page_table = engine.page_table
        # The graphs' inputs: a step's vectors, staged here in one copy (engine/decode_inputs.py).
        self.staged = torch.tensor(
            padding_columns(self.max_bs, page_table, engine.kv_pool.scratch_slot),
            dtype=torch.int64,
            device=dev,
        )
        # Row 0: page-table row per request; row 1: sequence length after this step (int32, as
        # the attention metadata has them: the graph narrows the staged rows into it).
        self.meta = self.staged[: SEQ_LENS + 1].to(torch.int32)
        self.zeros = torch.zeros(self.max_bs, dtype=torch.int32, device=dev)
        self.cu = torch.arange(self.max_bs + 1, dtype=torch.int32, device=dev)
        # One logits buffer for every captured size (outside the graph pool), so the graphs do
        # not each keep a [bs, vocab] output alive.
        # With TP the graphs end at this rank's vocabulary shard: whether to gather the whole
        # rows is a per-batch choice (engine/sample_step.py), made after the replay.
        width = engine.model.lm_head.rows_per_rank if engine.tp.size > 1 else engine.vocab_size
        self.logits = torch.empty((self.max_bs, width), dtype=torch.float32, device=dev)
        # The draw's inputs past the staged positions, and its tokens: the running set's
        # temperatures and seeds are copied in when the set changes (`_stage_draw`).
        self.draws = engine.tp.size == 1 and graph_draw_enabled()
        self.temperature = torch.zeros(self.max_bs, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self._drawing_for = None  # the SamplingTensors.temperature those buffers were copied from
        self._all_plain = False  # whether every request of that set draws plainly
        self._min_tokens: list[Req] = []  # those of its requests whose bans may still apply
        self.drawn_steps = 0  # steps whose tokens the graph drew (tests, A/B runs)
        self.capture()

    def _context(self, bs: int) -> ForwardContext:
        meta = AttentionMetadata(
            is_decode=True,
            table_idx=self.meta[0, :bs],
            prefix_lens=self.zeros[:bs],
            seq_lens=self.meta[1, :bs],
            cu_extend_lens=self.cu[: bs + 1],
            page_table=self.engine.page_table.slots,
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            max_extend_len=1,
        )
        return ForwardContext(meta, self.engine.kv_pool, self.engine.backend, self.staged[OUT_LOC, :bs])

    def _run(self, bs: int) -> torch.Tensor:
        """The captured step: from the staged vectors, the new slots into the page table, the
        input tokens out of the token table, then the model, its logits and the draw."""
        engine, model = self.engine, self.engine.model
        step = DecodeInputs(bs, self.staged[:, :bs])
        input_ids = step.start(engine.page_table, self.meta)
        hidden = model(input_ids, step.positions, self._context(bs))
        if self.engine.tp.size > 1:
            return model.shard_logits(hidden, out=self.logits[:bs])
        logits = model.compute_logits(hidden, out=self.logits[:bs])
        if self.draws:
            from minfer.kernels.sampling import gumbel_argmax

            table = (engine.page_table.tokens.view(-1), step.sampled_to)
            args = (logits, self.temperature[:bs], self.seeds[:bs], step.sampled_at)
            gumbel_argmax(*args, out=self.tokens[:bs], table=table)
        return logits

    def capture(self) -> None:
        what = f"CUDA graphs (batch sizes {self.batch_sizes[0]}..{self.max_bs})"
        self.graphs, self.memory_bytes = capture_graphs(self.batch_sizes, self._run, what)

    def release(self) -> None:
        release_graphs(self.graphs, self.device)

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def padded_size(self, batch_size: int) -> int:
        """The batch size of the graph a decode step of `batch_size` requests replays."""
        return next(s for s in self.batch_sizes if s >= batch_size)

    def replay(self, step: DecodeInputs, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits of the step's requests `reqs`, their next tokens if the graph's draw is theirs
        else None), the step staged into `self.staged` padded to `padded_size`
        (engine/decode_inputs.py), so the padding rows already point at the scratch slot."""
        bs = step.staged.shape[1]
        if step.staged.data_ptr() != self.staged.data_ptr():
            raise ValueError("a graphed decode step must be staged into CudaGraphRunner.staged")
        drawn = self._stage_draw(step, reqs) if self.draws else None
        self.graphs[bs].replay()
        return self.logits[: step.n], drawn

    def _stage_draw(self, step: DecodeInputs, reqs: list[Req]) -> torch.Tensor | None:
        """Stage the draw's temperatures and seeds if the running set changed; the buffer its
        tokens land in if every request draws plainly this step, else None. The host checks
        each request once per running set (81 us at batch 256) and then only min_tokens."""
        engine = self.engine
        st = engine.sampling_tensors.get(reqs, engine.vocab_size, self.device, step.sampled_at)
        if st.temperature is not self._drawing_for:  # a new set (the cache rebuilt its tensors)
            self._drawing_for = st.temperature
            self.temperature[: step.n].copy_(st.temperature)
            self.seeds[: step.n].copy_(st.seeds)
            self._all_plain = all(map(draws_plainly, reqs))
            self._min_tokens = [r for r in reqs if r.params.min_tokens]
        if self._all_plain and not any(map(banned_tokens, self._min_tokens)):
            self.drawn_steps += 1
            return self.tokens[: step.n]
        return None
