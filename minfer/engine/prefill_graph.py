"""CUDA graphs for prefill passes.

A prefill pass launches a few hundred kernels from Python (about nine per layer). On a busy
host that takes longer than the GPU needs to run them: an 8192-token pass of Qwen3-0.6B is
~17 ms of GPU work that took 17-42 ms to launch on the H200 host (docs/PERFORMANCE.md sections
9, 13 and 15). A pass of up to `--prefill-cuda-graph-max-tokens` tokens instead replays the
graph captured for the smallest token bucket that holds it:

- its tokens are copied into static buffers and padded to the bucket with one extra request
  (row `padding_row` of the page table, which points every position at the pool's scratch
  slot), so every row of the pass is a real computation with finite values;
- the attention metadata lives in static buffers too: fixed-size rows for up to
  `max_requests` requests (the unused ones have no tokens) and the extend kernel's tile map,
  padded to a fixed width with tiles that return at once (kernels/attention_extend.py);
- a pass whose longest extend takes the extend kernel's long-prompt tiles
  (`LONG_EXTEND`), or with more requests or tokens than captured, runs eagerly: such passes
  keep the GPU busy by themselves.

The graph ends at the final norm's hidden states; the engine picks the rows it samples or
scores and computes their logits after the replay, as for an eager pass.
"""

from __future__ import annotations

import torch

from minfer.attention.base import AttentionMetadata, ForwardContext
from minfer.device import to_device
from minfer.engine.cuda_graph import GraphInputs, capture_graphs, release_graphs
from minfer.kernels.attention_extend import LONG_EXTEND, extend_tiles, launch_config

# A graphed pass holds up to this many requests (the offline benchmark's 8192-token chunks hold
# 6-18; 8192 tokens of 100-token prompts, 82). A bucket's tile map has room for one partial tile
# per request it can hold, and each unused tile is a program per q head and layer that returns
# at once (~1-2 us per layer for the 8192-token bucket).
MAX_REQUESTS = 128


def prefill_graph_tokens(engine) -> int:
    """The largest prefill pass to capture, 0 for none: --prefill-cuda-graph-max-tokens
    (default: the chunk size), within the context length. None with tensor parallelism (its
    all-reduces of prefill sizes inside a graph are not yet checked on two GPUs). A MoE model's
    passes are captured up to the tokens whose expert assignments the Triton align kernel sorts
    (ALIGN_KERNEL_MAX_ROWS; above it a torch path syncs, which a graph cannot hold)."""
    from minfer.kernels.moe import ALIGN_KERNEL_MAX_ROWS
    from minfer.layers.moe import SparseMoeBlock

    cfg = engine.config
    tokens = cfg.prefill_cuda_graph_max_tokens
    tokens = cfg.chunked_prefill_size if tokens is None else tokens
    if not tokens or engine.tp.size > 1:
        return 0
    top_k = max([m.top_k for m in engine.model.modules() if isinstance(m, SparseMoeBlock)], default=0)
    if top_k:
        tokens = min(tokens, ALIGN_KERNEL_MAX_ROWS // top_k)
    return min(tokens, cfg.chunked_prefill_size, engine.max_model_len)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture, each at most 1/8 above the one before it (64-token steps up to
    1024, then 128 to 2048, ...): a pass pays for its padding in every GEMM, which on an 8B
    model costs about what a launch saves (a 320-token pass took 14.8-16.2 ms padded to 512
    against 13.5-14.2 ms launched eagerly on an H200)."""
    sizes, n = [], 64
    while n < max_tokens:
        sizes.append(n)
        n += max(64, 1 << (n.bit_length() - 4))  # 1/8 of the power of two at or below n
    return sizes + [max_tokens]


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def pass_metadata(
    tokens: int,
    width: int,
    tile_width: int,
    block_m: int,
    padding_row: int,
    table_idx: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
) -> list[int]:
    """A bucket's int32 buffer for one pass: rows of `width` entries for table_idx, prefix_lens,
    seq_lens and cu_extend_lens, then the tile map ([2, tile_width]). The real requests come
    first, then one padding request holding the bucket's remaining tokens (page-table row
    `padding_row`), then requests without tokens up to `width - 1`."""
    pad = tokens - sum(extend_lens)
    extends = list(extend_lens) + [pad]
    unused = width - len(extends)
    if unused < 1 or pad < 0:
        raise ValueError(f"{len(extend_lens)} requests of {sum(extend_lens)} tokens exceed the bucket")
    cu = [0]
    for n in extends:
        cu.append(cu[-1] + n)
    return (
        list(table_idx) + [padding_row] * (unused + 1)
        + list(prefix_lens) + [0] * (unused + 1)
        + [p + n for p, n in zip(prefix_lens, extend_lens)] + [pad] + [0] * unused
        + cu + [tokens] * (unused - 1)
        + [t for row in extend_tiles(extends, block_m, tile_width) for t in row]
    )  # fmt: skip


def metadata_views(buf: torch.Tensor, width: int, tokens: int, page_table: torch.Tensor) -> AttentionMetadata:
    """A `pass_metadata` buffer on the device as the pass's attention metadata."""
    return AttentionMetadata(
        is_decode=False,
        table_idx=buf[:width],
        prefix_lens=buf[width : 2 * width],
        seq_lens=buf[2 * width : 3 * width],
        cu_extend_lens=buf[3 * width : 4 * width],
        page_table=page_table,
        prefix_lens_cpu=[0],
        extend_lens_cpu=[tokens],
        max_extend_len=LONG_EXTEND - 1,  # the short tiles, which the tile map was made for
        extend_tiles=buf[4 * width :].view(2, -1),
    )


class PrefillGraphRunner:
    def __init__(self, engine, max_tokens: int, max_requests: int):
        self.engine = engine
        self.device = engine.device
        self.buckets = prefill_buckets(max_tokens)
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        dev = self.device
        self.padding_row = engine.page_table.padding_row
        # The launch configuration every graphed pass takes (its longest extend is short).
        self.block_m = launch_config(LONG_EXTEND - 1, True, engine.kv_pool.quantized)[0]
        self.inputs = GraphInputs(max_tokens, engine.kv_pool.scratch_slot, dev)
        # Per bucket one int32 buffer, filled by one host-to-device copy per replay: rows of
        # `self.width` for table_idx, prefix_lens, seq_lens and cu_extend_lens, then the tile
        # map. Every part starts at a multiple of 16 entries (the kernels' pointer alignment).
        self.width = _round16(max_requests + 2)  # + the padding request, + cu's extra entry
        self.meta: dict[int, torch.Tensor] = {}
        # Every graph's output, written by its last kernel: kept outside the graph pool, so
        # that the pool holds one bucket's intermediates rather than every bucket's output.
        self.hidden = torch.empty((max_tokens, engine.hf_config.hidden_size), dtype=engine.dtype, device=dev)
        self.replays = 0  # passes run from a graph (tests and benchmarks read it)
        self.capture()

    def _tile_width(self, tokens: int) -> int:
        # Each request's last tile may be partly empty: at most one extra tile per request, and
        # a bucket of n tokens holds at most n requests (+ the padding one).
        return _round16(-(-tokens // self.block_m) + min(self.max_requests, tokens) + 1)

    def _context(self, tokens: int) -> ForwardContext:
        meta = metadata_views(self.meta[tokens], self.width, tokens, self.engine.page_table.slots)
        return ForwardContext(meta, self.engine.kv_pool, self.engine.backend, self.inputs.out_loc[:tokens])

    def _host_meta(self, tokens: int, table_idx, prefix_lens, extend_lens) -> list[int]:
        args = (self.width, self._tile_width(tokens), self.block_m, self.padding_row)
        return pass_metadata(tokens, *args, table_idx, prefix_lens, extend_lens)

    def _run(self, tokens: int) -> None:
        inputs = self.inputs
        hidden = self.engine.model(
            inputs.input_ids[:tokens], inputs.positions[:tokens], self._context(tokens)
        )
        self.hidden[:tokens].copy_(hidden)

    def capture(self) -> None:
        for tokens in self.buckets:  # a pass of one request holding the whole bucket in its padding
            self.meta[tokens] = to_device(self._host_meta(tokens, [], [], []), torch.int32, self.device)
        what = f"prefill CUDA graphs ({self.buckets[0]}..{self.max_tokens} tokens)"
        self.graphs, self.memory_bytes = capture_graphs(self.buckets, self._run, what)

    def release(self) -> None:
        release_graphs(self.graphs, self.device)

    def can_run(self, extend_lens: list[int]) -> bool:
        return (
            len(extend_lens) <= self.max_requests
            and sum(extend_lens) <= self.max_tokens
            and max(extend_lens) < LONG_EXTEND
        )

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        table_idx: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the pass; returns (hidden [n, H], cu_extend_lens [B + 1] of the real requests).
        Both are views of static buffers: use them before the next replay is queued."""
        n = input_ids.shape[0]
        tokens = next(b for b in self.buckets if b >= n)
        self.inputs.stage(input_ids, positions, out_loc, tokens)  # the padding request: scratch slot
        buf = self.meta[tokens]
        host = torch.tensor(self._host_meta(tokens, table_idx, prefix_lens, extend_lens), dtype=torch.int32)
        buf.copy_(host.pin_memory(), non_blocking=True)
        self.graphs[tokens].replay()
        self.replays += 1
        w = self.width
        return self.hidden[:n], buf[3 * w : 3 * w + len(extend_lens) + 1]
