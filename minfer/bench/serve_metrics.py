"""What `minfer bench serve` measures per request, and the summary it reports over a run.

Definitions (all latencies in milliseconds in the report):
- TTFT: request sent -> first streamed chunk that carries output text.
- ITL: the gaps between consecutive content chunks of one request (every gap of every request).
- TPOT: (E2E - TTFT) / (output tokens - 1) per request, over requests with >= 2 output tokens.
- E2E: request sent -> the stream's end.
- goodput: requests per second whose TTFT, TPOT and E2E all meet the --slo limits given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass
class RequestRecord:
    """One request's outcome. Times are seconds; `start` and `end` are wall-clock (time.time()) so
    that records from several client processes can be merged onto one timeline."""

    index: int
    start: float
    end: float = 0.0
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0  # from the server's usage
    output_tokens: int = 0  # from the server's usage
    content_chunks: int = 0  # streamed chunks that carried output text
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "e2e": self.e2e, "tpot": self.tpot}


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft:500,tpot:50` -> {"ttft": 0.5, "tpot": 0.05} (seconds). Raises ValueError naming the bad part."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        name, sep, value = part.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo: {part!r} is not NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo: {value!r} of {name} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--slo: the {name} limit must be > 0 ms, got {value}")
        out[name] = ms / 1000
    return out


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a successful request meets every limit; a limit on TPOT holds for a one-token output."""
    if not record.ok:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}
    return all(values[name] is None or values[name] <= limit for name, limit in slo.items())


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (numpy's linear interpolation) and max of seconds, in milliseconds."""
    if not values_s:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}, "max": 0.0}
    ms = np.asarray(values_s, dtype=np.float64) * 1000
    return {
        "mean": float(ms.mean()),
        **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES},
        "max": float(ms.max()),
    }


def summarize(records: list[RequestRecord], slo: dict[str, float]) -> dict:
    """Every reported metric of a run. Duration spans the first request sent to the last one finished."""
    done = [r for r in records if r.ok]
    duration = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    per_s = 1 / duration if duration > 0 else 0.0
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    summary = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) * per_s,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (prompt_tokens + output_tokens) * per_s,
        # Requests whose streamed content chunks differ from the usage's completion_tokens: a chunk
        # may carry several tokens (or none, while a multi-byte character is incomplete).
        "chunk_token_mismatches": sum(r.content_chunks != r.output_tokens for r in done),
        "ttft_ms": distribution_ms([r.ttft for r in done]),
        "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in done]),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in done)
        summary["slo_ms"] = {name: limit * 1000 for name, limit in slo.items()}
        summary["good_requests"] = good
        summary["goodput"] = good * per_s
    return summary
