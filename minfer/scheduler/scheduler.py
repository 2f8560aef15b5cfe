"""The scheduler: owns request state and every admission decision.

One step: schedule (a prefill batch if anything waits and fits, else a decode batch of all
running requests) -> allocate KV slots -> engine forward -> process results (advance the
three lengths, append tokens, finish, free). Requests join and leave between steps.

Queues
  waiting     accepted, not yet holding KV (new, or preempted with their tokens kept)
  prefilling  holding KV, prompt not fully computed yet (chunked prefill), at most a few
  running     prompt computed; one token per decode step
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

from minfer.config import EngineConfig
from minfer.core import Batch, InvalidRequestError, Phase, Req, SamplingParams, TokenLogprobs
from minfer.engine.engine import Engine, ForwardResult
from minfer.kvcache.manager import KVManager
from minfer.observability.trace import NULL_TRACER, RequestTracer, slot_ranges

log = logging.getLogger(__name__)

# Prompts whose first this-many tokens agree are assumed to share a prefix worth waiting for.
SHARED_HEAD_TOKENS = 32


@dataclass
class StepOutput:
    """What one step produced for one request: a new token and/or the end of the request."""

    uid: int
    token_id: int | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that ended it, when one did
    logprobs: TokenLogprobs | None = None  # of token_id, when the request asked
    prompt_logprobs: TokenLogprobs | None = None  # with the first token, when the request asked


@dataclass
class SchedulerCounters:
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_batch_total: int = 0  # sum of decode batch sizes (mean = this / decode_steps)
    prefill_seconds: float = 0.0  # wall time of steps, from scheduling to tokens on the CPU
    decode_seconds: float = 0.0
    # decode steps and their seconds by batch size, in power-of-two bands keyed by the band's
    # lowest size (1, 2, 4, ...): where a run's decode time goes as its batch drains
    decode_by_batch: dict[int, list] = field(default_factory=dict)


class Scheduler:
    def __init__(self, engine: Engine, config: EngineConfig | None = None, tracer: RequestTracer | None = None):
        self.engine = engine
        self.config = config or engine.config
        if tracer is None:
            tracer = RequestTracer(self.config.trace_requests) if self.config.trace_requests else NULL_TRACER
        self.tracer = tracer
        # Free KV a running request may need before the next admission: one page each, so an
        # admitted batch does not preempt itself on its first decode step.
        self.decode_reserve_pages = 1
        self.kv = KVManager(engine.kv_pool.num_slots, self.config.page_size, engine.page_table,
                            self.config.cache)
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self.by_uid: dict[int, Req] = {}
        self.in_flight: tuple[Batch, ForwardResult] | None = None  # launched, tokens not read yet
        self.counters = SchedulerCounters()
        self._seed_source = random.Random(self.config.seed)
        self._uids = itertools.count()
        if self.tracer.enabled:  # uid -1: the run itself, so readers know the pool's geometry
            self.tracer.emit("kv_pool", -1, num_slots=self.kv.num_pages * self.kv.page_size,
                             page_size=self.kv.page_size)

    # -- intake --------------------------------------------------------------------------------
    def new_uid(self) -> int:
        return next(self._uids)

    def add_request(self, token_ids: list[int], params: SamplingParams, uid: int | None = None,
                    arrival_time: float | None = None) -> Req:
        """Validate and queue a request; raises InvalidRequestError naming the limit it breaks."""
        params.validate()
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        max_len = self.engine.max_model_len
        if len(token_ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_len} tokens, but the request has "
                f"{len(token_ids)} prompt tokens and max_tokens={params.max_tokens} "
                f"({len(token_ids) + params.max_tokens} in total)", "max_tokens", "context_length_exceeded")
        # A request alone in the pool must be able to finish, or preemption could not help it.
        pool_tokens = (self.kv.num_pages - self.decode_reserve_pages) * self.config.page_size
        if len(token_ids) + params.max_tokens > pool_tokens:
            raise InvalidRequestError(
                f"the request needs {len(token_ids)} prompt + {params.max_tokens} max_tokens KV slots, more than "
                f"the whole KV pool holds ({pool_tokens} tokens)", "max_tokens")
        for field_name, ids in (("prompt", token_ids), ("logit_bias", params.logit_bias),
                                ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.engine.vocab_size})", field_name)
        grammar = None
        if params.structured_output is not None:
            if self.engine.tp.size > 1 or self.engine.tokenizer is None:
                raise InvalidRequestError("structured output needs a tokenizer and tp=1", "response_format")
            grammar = self.engine.grammar_backend().matcher(params.structured_output)
        uid = self.new_uid() if uid is None else uid
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(32)
        req = Req(uid=uid, token_ids=list(token_ids), prompt_len=len(token_ids), params=params,
                  eos_token_ids=self.engine.eos_token_ids, seed=seed,
                  arrival_time=arrival_time if arrival_time is not None else time.monotonic(), grammar=grammar)
        self.by_uid[uid] = req
        self.waiting.append(req)
        self.counters.prompt_tokens += len(token_ids)
        if self.tracer.enabled:
            self.tracer.emit("queued", uid, prompt_len=req.prompt_len, max_tokens=params.max_tokens)
        return req

    def abort(self, uid: int) -> StepOutput | None:
        """End a request wherever it is; its KV is freed now. None if it is unknown or done."""
        req = self.by_uid.get(uid)
        if req is None:
            return None
        if req in self.prefilling:
            self.prefilling.remove(req)
        self.finish(req, "abort")
        return StepOutput(uid, None, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.in_flight)

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        return self.schedule_prefill() or self.schedule_decode()

    def order_waiting(self) -> None:
        """Longest-prefix-match policy: requests whose prompt the cache already holds most of go
        first, so shared prefixes are reused before they are evicted. FCFS keeps arrival order.
        Preempted requests stay at the front either way (they were admitted before)."""
        if self.config.schedule_policy != "lpm" or len(self.waiting) < 2:
            return
        cache = self.kv.prefix_cache
        resumed = [r for r in self.waiting if r.preempted]
        fresh = sorted((r for r in self.waiting if not r.preempted),
                       key=lambda r: -cache.prefix_length(r.token_ids[:r.device_len - 1]))
        self.waiting = deque(resumed + fresh)

    def schedule_prefill(self) -> Batch | None:
        self.order_waiting()
        budget = self.config.chunked_prefill_size
        reqs, lens = [], []
        free_pages = self.kv.available_pages - self.decode_reserve_pages * len(self.running)
        # Requests already holding KV finish their prompts first.
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.extend_len, budget)
            need = self.kv.pages_needed(req, n)
            if need > free_pages:
                break
            free_pages -= need
            reqs.append(req)
            lens.append(n)
            budget -= n
        # Requests admitted in this batch (or still prefilling in chunks) are not in the prefix cache
        # yet; a waiting request that starts like one of them waits and then reuses its prefix
        # instead of recomputing it.
        admitted_heads: set[tuple[int, ...]] = set()
        for req in self.prefilling:
            head = self.shareable_head(req)
            if head and self.kv.prefix_cache.prefix_length(list(head)) < len(head):
                admitted_heads.add(head)
        deferred: list[Req] = []
        while self.waiting and budget > 0:
            active = len(self.running) + len(self.prefilling)
            if active >= self.engine.max_running_requests or self.kv.page_table.num_free_rows == 0:
                break
            req = self.waiting[0]
            head = self.shareable_head(req)
            if head and head in admitted_heads and not req.output_len:
                deferred.append(self.waiting.popleft())
                continue
            evictable_before = self.kv.prefix_cache.evictable_pages
            cache_counters = self.kv.prefix_cache.counters
            counted = (cache_counters.queried_tokens, cache_counters.hit_tokens)
            self.kv.admit(req)
            # The matched prefix is now locked: it no longer counts as room we could evict.
            free_pages -= evictable_before - self.kv.prefix_cache.evictable_pages
            n = min(req.extend_len, budget)
            need = self.kv.pages_needed(req, n) + self.decode_reserve_pages
            if need > free_pages:
                self.kv.release(req)  # give back the row and the prefix lock; try again later
                req.cached_len = 0
                # Count the prefix query once, when the request is really admitted.
                cache_counters.queried_tokens, cache_counters.hit_tokens = counted
                break
            self.waiting.popleft()
            if head and req.cached_len < len(head):
                admitted_heads.add(head)
            if self.tracer.enabled:
                if req.preempted:
                    self.tracer.emit("resumed", req.uid, **req.state())
                self.tracer.emit("prefix_matched", req.uid, hit_tokens=req.cached_len,
                                 queried_tokens=req.device_len - 1)
            req.preempted = False
            free_pages -= need
            self.prefilling.append(req)
            reqs.append(req)
            lens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        if not reqs:
            return None
        batch = Batch(Phase.PREFILL, reqs, lens)
        batch.sample_mask = [r.cached_len + n == r.device_len for r, n in zip(reqs, lens)]
        return batch

    def shareable_head(self, req: Req) -> tuple[int, ...] | None:
        """The first SHARED_HEAD_TOKENS tokens, or a shorter prompt's whole known part (so the n
        copies of one short request share it too); None when too short to be worth a wait."""
        head = tuple(req.token_ids[:min(SHARED_HEAD_TOKENS, req.device_len - 1)])
        if len(head) == SHARED_HEAD_TOKENS or (len(head) == req.device_len - 1
                                                and len(head) >= max(1, self.config.page_size)):
            return head
        return None

    def schedule_decode(self) -> Batch | None:
        # A request whose in-flight step (overlap mode) reaches max_tokens needs no more steps.
        # A grammar needs its previous token accepted before it can mask the next (grammar.py).
        reqs = [r for r in self.running if r.device_len - r.prompt_len < r.params.max_tokens
                and (r.grammar is None or len(r.token_ids) == r.device_len)]
        if not reqs:
            return None
        # Each request needs a slot for its newest token; free some by preemption, half-
        # prefilled requests first, then the newest running ones. The oldest always fits alone
        # (add_request checks prompt + max_tokens against the pool).
        while not self.kv.reserve_pages(sum(self.kv.pages_needed(r, 1) for r in reqs)):
            victim = self.prefilling[-1] if self.prefilling else reqs[-1]
            self.preempt(victim)
            if victim in reqs:
                reqs.remove(victim)
            if not reqs:
                return None
        batch = Batch(Phase.DECODE, reqs, [1] * len(reqs))
        batch.sample_mask = [True] * len(reqs)
        return batch

    def preempt(self, req: Req) -> None:
        """Send a request back to the front of the queue, keeping its tokens; its KV goes to the
        prefix cache (so resuming may reuse it) or back to the pool."""
        (self.prefilling if req in self.prefilling else self.running).remove(req)
        if self.tracer.enabled:
            self.tracer.emit("preempted", req.uid, **req.state())
        self._release(req)
        req.cached_len = 0
        req.preempted = True
        self.waiting.appendleft(req)
        self.counters.preemptions += 1
        log.debug("preempted request %d at %d tokens", req.uid, req.device_len)

    # -- one step ------------------------------------------------------------------------------
    @property
    def overlap(self) -> bool:
        # Also on by default on CPU, where nothing runs concurrently but the same code path is tested.
        return not self.config.disable_overlap_schedule

    def step(self) -> list[StepOutput]:
        """One turn of the loop: schedule and launch a batch, then read the previous batch's tokens.

        Request lengths advance when a batch is launched, so the next batch can be scheduled
        before this one's tokens reach the CPU (overlap mode: the CPU work of step N+1 runs
        while the device computes step N). Without overlap, a batch is read right after launch.
        """
        start = time.perf_counter()
        batch = self.schedule()
        launched = None
        if batch is not None:
            batch.out_loc = self.kv.allocate(batch.reqs, batch.extend_lens)
            if self.tracer.enabled:
                self._trace_scheduled(batch)
            launched = (batch, self.engine.forward_batch(batch))
            self.advance(batch)
        outputs = []
        if self.in_flight is not None:
            outputs = self.process(*self.in_flight)
            self.in_flight = None
        if launched is not None:
            if self.overlap:
                self.in_flight = launched
            else:
                outputs += self.process(*launched)
            self._count_step(batch, time.perf_counter() - start)
        return outputs

    def _trace_scheduled(self, batch: Batch) -> None:
        start = 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            self.tracer.emit("batch_scheduled", req.uid, phase=batch.phase.value, batch_size=batch.size, chunk=n)
            self.tracer.emit("kv_slots_allocated", req.uid, **req.state(), num_slots=n,
                             out_loc=slot_ranges(batch.out_loc[start:start + n]), table_idx=req.table_idx)
            start += n

    def advance(self, batch: Batch) -> None:
        """The launched pass computes each request's K/V for its chunk and (where it samples) one
        more token, now known on the device."""
        for req, n, sampled in zip(batch.reqs, batch.extend_lens, batch.sample_mask):
            before = req.state() if self.tracer.enabled else None
            moved = None
            req.cached_len += n
            if batch.phase == Phase.PREFILL:
                self.counters.prefill_tokens_computed += n
            if sampled:
                req.device_len += 1
                if batch.phase == Phase.PREFILL:
                    self.prefilling.remove(req)
                    self.running.append(req)
                    moved = self.kv.cache_prompt(req)
            if before is not None:
                self.tracer.emit("request_state_updated", req.uid, before=before, after=req.state())
                if moved is not None:
                    self.tracer.emit("prompt_cached", req.uid, cached_len=req.cached_len,
                                     repointed=[list(m) for m in moved])

    def _count_step(self, batch: Batch, seconds: float) -> None:
        c = self.counters
        if batch.phase == Phase.PREFILL:
            c.prefill_steps += 1
            c.prefill_seconds += seconds
        else:
            c.decode_steps += 1
            c.decode_batch_total += batch.size
            c.decode_seconds += seconds
            band = c.decode_by_batch.setdefault(1 << (batch.size.bit_length() - 1), [0, 0.0])
            band[0] += 1
            band[1] += seconds

    def process(self, batch: Batch, result: ForwardResult) -> list[StepOutput]:
        """Tokens of a finished pass reach the CPU: append them, decide which requests end."""
        outputs = []
        tokens = result.tokens()
        sampled_logprobs, prompt_logprobs = result.logprobs()
        for i, first, rows in prompt_logprobs:
            req = batch.reqs[i]
            if req.prompt_logprobs is None:
                req.prompt_logprobs = {}
            req.prompt_logprobs.update(zip(range(first, first + len(rows)), rows))
        if self.tracer.enabled:
            for req in batch.reqs:
                if not req.finished:
                    self.tracer.emit("forward_done", req.uid, phase=batch.phase.value)
        for i, token in zip(result.sampled_rows, tokens):
            req = batch.reqs[i]
            if req.finished:
                continue  # aborted, or ended by the previous pass while this one was in flight
            if self.tracer.enabled:
                self.tracer.emit("token_sampled", req.uid, token_id=token, output_len=req.output_len + 1)
            req.token_ids.append(token)
            self.counters.generation_tokens += 1
            reason, stop_reason = self.finish_reason(req, token)
            if req.grammar is not None and not reason:
                req.grammar.accept_token(token)
                if req.grammar.is_terminated():
                    reason = "stop"
            if reason:
                self.finish(req, reason)
            out = StepOutput(req.uid, token, reason, stop_reason)
            if i in sampled_logprobs:
                logprob, top_ids, top_values = sampled_logprobs[i]
                k = req.params.logprobs
                out.logprobs = TokenLogprobs([token], [logprob], [top_ids[:k]], [top_values[:k]])
            if req.output_len == 1 and req.params.prompt_logprobs is not None:
                out.prompt_logprobs = prompt_logprobs_of(req)
            outputs.append(out)
        return outputs

    def finish(self, req: Req, reason: str) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:  # preempted while its last pass was in flight
            self.waiting.remove(req)
        if req.table_idx >= 0:
            self._release(req)
        req.device_len = len(req.token_ids)  # forget a pass launched after the end (overlap)
        del self.by_uid[req.uid]
        if self.tracer.enabled:
            event = "aborted" if reason == "abort" else "finished"
            self.tracer.emit(event, req.uid, reason=reason, prompt_len=req.prompt_len,
                             output_len=req.output_len, **req.state())

    def _release(self, req: Req) -> None:
        """Hand the request's KV back (prefix cache or allocator), tracing which slots went where."""
        slots = self.kv.release(req)
        if self.tracer.enabled:
            ps = self.kv.page_size
            kept = (req.cached_len // ps) * ps
            self.tracer.emit("kv_released", req.uid, cached=slot_ranges(slots[:kept]),
                             freed=slot_ranges(slots[kept:]), cached_len=req.cached_len)

    def finish_reason(self, req: Req, token: int) -> tuple[str | None, int | None]:
        p = req.params
        if req.output_len >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop", token
            if not p.ignore_eos and token in req.eos_token_ids:
                return "stop", None
        if req.output_len >= p.max_tokens or req.device_len >= self.engine.max_model_len:
            return "length", None
        return None, None


def prompt_logprobs_of(req: Req) -> TokenLogprobs:
    """The prompt's logprobs, gathered chunk by chunk during prefill; nothing scores the first token."""
    k = req.params.prompt_logprobs
    scored = req.prompt_logprobs or {}
    out = TokenLogprobs(list(req.token_ids[:req.prompt_len]), [None], [[]], [[]])
    for position in range(req.prompt_len - 1):
        logprob, top_ids, top_values = scored[position]
        out.logprobs.append(logprob)
        out.top_ids.append(top_ids[:k])
        out.top_logprobs.append(top_values[:k])
    req.prompt_logprobs = None
    return out
