"""The engine: one per TP rank. Owns the model, the KV pool, the attention backend and the
sampler; turns a scheduled batch into next tokens. It decides nothing about which requests run.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
from dataclasses import dataclass, field

import torch

from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.choice import make_attention_backend, wants_head_major_pool
from minfer.config import (
    ConfigError,
    EngineConfig,
    default_chunked_prefill_size,
    default_max_running_requests,
)
from minfer.core import Batch, LogprobRow, Phase
from minfer.device import set_cpu_threads, set_gpu_host_threads, to_device
from minfer.distributed.parallel import SINGLE, TPGroup
from minfer.engine.decode_inputs import stage_decode_inputs
from minfer.engine.graphs import capture_cuda_graphs
from minfer.engine.logprobs import LogprobTensors, prompt_logprob_spans, reduce_logprobs, rows_of
from minfer.engine.memory import MemoryBudget, device_memory_in_use, plan_memory
from minfer.engine.sample_step import sample_into_table
from minfer.engine.sampler import SamplingTensorCache
from minfer.kvcache.host_pool import HostKVPool, host_available_bytes
from minfer.kvcache.page_table import PageTable, runs_of_positions
from minfer.kvcache.pool import KVPool
from minfer.layers.rotary import context_length
from minfer.models.generation_config import generation_settings
from minfer.models.llama import head_dim_of
from minfer.models.loader import (
    build_model,
    eos_token_ids,
    load_hf_config,
    load_tokenizer,
    model_source,
    resolve_dtype,
)

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    return torch.device(name)


@dataclass
class ForwardResult:
    """Next tokens of the requests that sampled this pass (indices into batch.reqs), and the
    logprobs asked for (reduced on the device: a few numbers per token).

    Everything is copied to the CPU asynchronously: `tokens()` and `logprobs()` wait for that
    copy only, so the scheduler can prepare the next batch while the device still computes this one.
    """

    next_tokens: torch.Tensor  # on the device
    sampled_rows: list[int]
    # Logprobs of the sampled tokens of batch.reqs[i] for i in logprob_rows.
    sampled_logprobs: LogprobTensors | None = None
    logprob_rows: list[int] = field(default_factory=list)
    # Prompt logprobs: per span (req index, first position, count), rows in span order.
    prompt_logprobs: LogprobTensors | None = None
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)
    _host: list[torch.Tensor] | None = None
    _ready: object | None = None  # a CUDA event recorded after the copies

    def _device_tensors(self) -> list[torch.Tensor]:
        out = [self.next_tokens]
        for part in (self.sampled_logprobs, self.prompt_logprobs):
            if part is not None:
                out += part.tensors()
        return out

    def start_copy(self) -> None:
        """Queue the copies to pinned host memory (CUDA only; on CPU the tensors are the result)."""
        if self.next_tokens.device.type != "cuda":
            return
        self._host = []
        for t in self._device_tensors():
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._host.append(host)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def _read(self) -> list[torch.Tensor]:
        if self._ready is not None:
            self._ready.synchronize()
            return self._host
        return self._device_tensors()

    def tokens(self) -> list[int]:
        return self._read()[0].tolist()

    def logprobs(self) -> tuple[dict[int, LogprobRow], list[tuple[int, int, list[LogprobRow]]]]:
        """(req index -> the row of its sampled token, [(req index, first position, per-position
        rows)] of prompt logprobs)."""
        host = self._read()[1:]
        sampled, prompt = {}, []
        if self.sampled_logprobs is not None:
            sampled = dict(zip(self.logprob_rows, rows_of(LogprobTensors(*host[:4]))))
            host = host[4:]
        if self.prompt_logprobs is not None:
            rows = rows_of(LogprobTensors(*host[:4]))
            start = 0
            for index, first, count in self.prompt_spans:
                prompt.append((index, first, rows[start : start + count]))
                start += count
        return sampled, prompt


def freeze_long_lived_objects() -> None:
    """Move every object alive now out of the garbage collector's reach (gc.freeze).

    Start-up leaves hundreds of thousands of objects that live as long as the process (the
    model's modules and parameters, the tokenizer, loader metadata). Python's full collections,
    triggered by allocation counts while serving, walk all of them each time: 0.1-0.2 s with the
    CPU loop stalled, which on a GPU is a stall of the whole pipeline. Call it once the engine is
    built, in a process that keeps that engine for life (frozen garbage is never collected).
    At exit they are handed back, so that interpreter shutdown finalizes them as usual.
    """
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


class Engine:
    def __init__(self, config: EngineConfig, tp: TPGroup = SINGLE):
        self.config = config
        self.tp = tp
        self.vocab_parallel_draws = 0  # batches drawn shard by shard (engine/vocab_parallel.py)
        self.sampling_tensors = SamplingTensorCache()  # consecutive decode steps share them
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            if tp.size > 1:  # one GPU per rank of this node
                self.device = torch.device("cuda", tp.local_rank)
            torch.cuda.set_device(self.device.index or 0)
        if config.chunked_prefill_size is None:  # its default depends on the device (config.py)
            config.chunked_prefill_size = default_chunked_prefill_size(self.device.type, config.quantization)
        if self.device.type == "cpu" and tp.size == 1:  # TP ranks set theirs on joining (parallel.py)
            set_cpu_threads(config.cpu_threads)
        elif self.device.type == "cuda":
            set_gpu_host_threads(config.cpu_threads)
        self.source = model_source(config)
        self.hf_config = load_hf_config(self.source)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        positions = context_length(self.hf_config)  # max_position_embeddings, longer with YaRN
        self.max_model_len = config.max_model_len or positions
        if self.max_model_len > positions:  # refused, as by vLLM (it was cut without a word)
            raise ConfigError(
                f"--max-model-len {config.max_model_len} is longer than the model's context of "
                f"{positions} tokens (its config's max_position_embeddings and rope scaling)"
            )
        self.vocab_size = self.hf_config.vocab_size

        memory_before = device_memory_in_use(self.device)
        self.model = build_model(
            self.source,
            self.hf_config,
            self.dtype,
            self.device,
            tp,
            self.max_model_len,
            config.seed,
            config.quantization,
        )
        self.tokenizer = load_tokenizer(self.source) if tp.rank == 0 else None
        # generation_config.json: more end-of-turn ids, and the sampling defaults the api applies
        more_eos, self.sampling_defaults = generation_settings(self.source.path, config.generation_config)
        self.eos_token_ids = eos_token_ids(self.hf_config, self.tokenizer) | more_eos
        low_bit = getattr(self.model, "quantized", False)
        self.backend = make_attention_backend(config.attention_backend, self.device, low_bit)

        attn = self.model.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, head_dim_of(self.hf_config)
        self.kv_bytes_per_token = KVPool.bytes_per_token(
            self.hf_config.num_hidden_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            config.kv_cache_dtype,
        )
        self.memory: MemoryBudget = plan_memory(self, memory_before)
        self.max_running_requests = config.max_running_requests or default_max_running_requests(
            self.device.type, config.quantization
        )
        page = config.page_size
        num_slots = self.memory.kv_pool_tokens // page * page
        self.kv_pool = KVPool(
            self.hf_config.num_hidden_layers,
            num_slots,
            self.num_kv_heads,
            self.head_dim,
            page,
            self.dtype,
            self.device,
            config.kv_cache_dtype,
            head_major=wants_head_major_pool(self.backend, self.device),
        )
        self.host_kv_pool: HostKVPool | None = None  # the second KV tier, behind the radix cache
        if config.host_kv_cache_gb > 0:
            self.host_kv_pool = HostKVPool.sized(
                self.kv_pool, config.host_kv_cache_gb, page, pin=self.device.type == "cuda"
            )
            self.memory.host_kv_tokens = self.host_kv_pool.num_slots
            self.memory.host_kv_bytes = self.host_kv_pool.num_bytes
            self.memory.host_available_bytes = host_available_bytes()
        self.page_table = PageTable(self.max_running_requests, self.max_model_len, self.device)
        self.page_table.point_padding_row_at(self.kv_pool.scratch_slot)
        self.graphs = self.prefill_graphs = None  # CUDA graphs: decode steps, prefill passes
        self._grammar = None  # GrammarBackend, made by the first structured-output request
        if self.device.type == "cuda" and self.backend.name == "triton":
            capture_cuda_graphs(self)
        log.info("%s", self.memory.describe(self.max_model_len))

    def release_cuda_graphs(self) -> None:
        """Drop the graphs (later passes run eagerly); before a TP group is left."""
        for runner in (self.graphs, self.prefill_graphs):
            if runner is not None:
                runner.release()
        self.graphs = self.prefill_graphs = None

    # -- one forward pass ----------------------------------------------------------------------
    def forward_batch(self, batch: Batch) -> ForwardResult:
        """Run the model over the batch's new tokens and sample where a request completes its
        known tokens (decode, or the last chunk of a prefill). Returns without waiting for the
        device; `ForwardResult.tokens()` waits."""
        reqs = batch.reqs
        is_decode = batch.phase == Phase.DECODE
        prefix_lens = [r.cached_len for r in reqs]
        table_idx = [r.table_idx for r in reqs]
        # One host-to-device copy for the per-token vectors (row, position, slot; and at decode
        # what the graph, the sampler and the token table read too: engine/decode_inputs.py).
        graphed = is_decode and self.graphs is not None and self.graphs.can_run(len(reqs))
        step = None
        if is_decode:
            width = self.graphs.padded_size(len(reqs)) if graphed else len(reqs)
            scratch = self.kv_pool.scratch_slot
            into = self.graphs.staged if graphed else None  # a graph reads its inputs there
            step = stage_decode_inputs(
                reqs, batch.out_loc, width, self.page_table, scratch, self.device, into
            )
            if not graphed:  # the graph starts the same way itself
                input_ids = step.start(self.page_table)
                positions_d, out_loc = step.positions, step.out_loc
        else:
            rows, positions = runs_of_positions(table_idx, prefix_lens, batch.extend_lens)
            slots = torch.as_tensor(batch.out_loc, dtype=torch.int64)
            rows_d, positions_d, out_loc = to_device(
                torch.stack([rows, positions, slots]), torch.int64, self.device
            )
            input_ids = self.page_table.gather_tokens(rows_d, positions_d)
        sampled_rows = [i for i, s in enumerate(batch.sample_mask) if s]
        prompt_spans = [] if is_decode else prompt_logprob_spans(batch)
        prompt_logprobs = None
        with torch.inference_mode():
            drawn = None  # the tokens a decode graph drew, where they are the batch's
            if graphed:
                logits, drawn = self.graphs.replay(step, reqs)
            else:
                extend_lens = list(batch.extend_lens)
                graphs = self.prefill_graphs  # a prefill pass replays a graph where one holds it
                if not is_decode and graphs is not None and graphs.can_run(extend_lens):
                    args = (input_ids, positions_d, out_loc, table_idx, prefix_lens, extend_lens)
                    hidden, cu_extend_lens = graphs.replay(*args)
                else:
                    meta = build_metadata(
                        table_idx, prefix_lens, extend_lens, self.page_table.slots, is_decode, self.device
                    )
                    ctx = ForwardContext(meta, self.kv_pool, self.backend, out_loc)
                    hidden, cu_extend_lens = self.model(input_ids, positions_d, ctx), meta.cu_extend_lens
                if prompt_spans:
                    prompt_logprobs = self._prompt_logprobs(batch, hidden, prompt_spans)
                if not sampled_rows:
                    result = ForwardResult(
                        torch.empty(0, dtype=torch.int64, device=self.device),
                        [],
                        prompt_logprobs=prompt_logprobs,
                        prompt_spans=prompt_spans,
                    )
                    result.start_copy()
                    return result
                if not is_decode:
                    ends = cu_extend_lens[1:].long() - 1
                    if len(sampled_rows) < len(reqs):
                        ends = ends[to_device(sampled_rows, torch.int64, self.device)]
                    hidden = hidden[ends]
                # With TP the vocabulary stays sharded here: sample_step gathers only if it must.
                logits = (
                    self.model.shard_logits(hidden) if self.tp.size > 1 else self.model.compute_logits(hidden)
                )
            chosen = [reqs[i] for i in sampled_rows]
            if drawn is not None:  # the graph drew them, into the token table too
                next_tokens, sampled_logprobs, logprob_rows = drawn, None, []
            else:
                next_tokens, sampled_logprobs, logprob_rows = sample_into_table(self, chosen, logits, step)
        result = ForwardResult(
            next_tokens,
            sampled_rows,
            sampled_logprobs,
            [sampled_rows[j] for j in logprob_rows],
            prompt_logprobs,
            prompt_spans,
        )
        result.start_copy()
        return result

    def grammar_backend(self):
        """The xgrammar compiler of this model's tokenizer, made on first use (rank 0 only)."""
        if self._grammar is None:
            from minfer.engine.grammar import GrammarBackend

            self._grammar = GrammarBackend(self.tokenizer, self.vocab_size)
        return self._grammar

    def _prompt_logprobs(
        self, batch: Batch, hidden: torch.Tensor, spans: list[tuple[int, int, int]]
    ) -> LogprobTensors:
        """Logits of the spans' hidden rows only, reduced to logprobs on the device."""
        offsets = list(itertools.accumulate(batch.extend_lens, initial=0))  # each request's first row
        rows, targets = [], []
        for i, first, count in spans:
            req = batch.reqs[i]
            start = offsets[i] + first - req.cached_len
            rows.extend(range(start, start + count))
            targets.extend(req.token_ids[first + 1 : first + 1 + count])
        index = to_device([rows, targets], torch.int64, self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index[0]))
        k = max(batch.reqs[i].params.prompt_logprobs for i, _, _ in spans)
        return reduce_logprobs(logits, index[1], k)
