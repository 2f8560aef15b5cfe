"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Randomness comes from a counter-based hash of (request seed, position, vocabulary index)
rather than from a shared generator: a request's draws then depend only on its own seed and
position, so a seeded request samples the same tokens whatever else is in the batch and
whatever order the batch is in. The draw uses the Gumbel-max trick:
argmax(logits / T + Gumbel noise) is a sample from softmax(logits / T).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from minfer.core import NO_TOKEN, SamplingParams
from minfer.device import to_device

_M32 = 0xFFFFFFFF


def table_token(tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` with NO_TOKEN replaced by a real id (0), for what indexes with them on the
    device: the token table, which the next pass may already be reading, and logprob targets."""
    return tokens.clamp(min=0)


def mark_undrawable(tokens: torch.Tensor, chosen_values: torch.Tensor) -> torch.Tensor:
    """tokens, NO_TOKEN where the value that won the row's draw is not finite."""
    return torch.where(chosen_values.isfinite(), tokens, NO_TOKEN)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one batch, on the device."""

    temperature: torch.Tensor  # [B] float32; 0 marks a greedy row
    top_k: torch.Tensor  # [B] int64; vocab size when disabled
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: the position the sampled token will occupy
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingTensors:
        temps = [0.0 if p.greedy else p.temperature for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        floats = to_device(
            [temps, [p.top_p for p in params], [p.min_p for p in params]], torch.float32, device
        )
        ints = to_device([top_k, [s & _M32 for s in seeds], positions], torch.int64, device)
        return cls(
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            top_k=ints[0],
            seeds=ints[1],
            positions=ints[2],
            all_greedy=all(t == 0 for t in temps),
            any_top_k=any(k < vocab_size for k in top_k),
            any_top_p=any(p.top_p < 1 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
        )


class SamplingTensorCache:
    """SamplingTensors for passes over the same requests in the same order (decode steps between
    two changes of the running set): the per-request parameters and seeds are built and staged
    once, and each pass stages only its positions. A request's sampling parameters and seed do
    not change while it lives. Compared by identity, so a request object held here stays alive
    (and its address unused) until the next change; at batch 1 this halves the host's work of
    building them (docs/BENCHMARKS.md, "Host work of a decode step")."""

    def __init__(self):
        self._reqs: tuple = ()
        self._tensors: SamplingTensors | None = None

    def get(
        self, reqs: list, vocab_size: int, device: torch.device, positions: torch.Tensor | None = None
    ) -> SamplingTensors:
        """SamplingTensors of `reqs` (minfer.core.Req) at their current positions (device_len),
        which `positions` holds already on the device when given."""
        same = len(reqs) == len(self._reqs) and all(a is b for a, b in zip(reqs, self._reqs))
        if not same or self._tensors is None:
            self._reqs = tuple(reqs)
            self._tensors = SamplingTensors.build(
                [r.params for r in reqs],
                [r.seed for r in reqs],
                [r.device_len for r in reqs],
                vocab_size,
                device,
            )
            return self._tensors
        if positions is None:
            positions = to_device([r.device_len for r in reqs], torch.int64, device)
        self._tensors = dataclasses.replace(self._tensors, positions=positions)
        return self._tensors


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply rounds) on int64 tensors holding u32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def noise_bits(
    seeds: torch.Tensor, positions: torch.Tensor, num_cols: int, col_offset: int = 0
) -> torch.Tensor:
    """[B, num_cols] 32-bit hashes (in int64) of (seed, position, vocab index) for the vocabulary
    entries col_offset .. col_offset + num_cols - 1: the randomness of every draw."""
    row_key = _mix32((seeds * 0x9E3779B1 + positions * 0x85EBCA77 + 0x165667B1) & _M32)
    col = torch.arange(col_offset, col_offset + num_cols, device=seeds.device, dtype=torch.int64)
    return _mix32((row_key[:, None] ^ ((col[None, :] * 0x27D4EB2F) & _M32)) + 0x61C88647 & _M32)


# A uniform is the top 23 bits of a hash as (k + 0.5) / 2**23: every such value is exact in
# float32 and strictly inside (0, 1). With 24 bits, k + 0.5 needed 25 bits of mantissa and the
# largest k rounded up to 2**24: u was exactly 1, its Gumbel noise +inf, and that vocabulary
# entry won the draw whatever its logit (one draw in ~110 over Qwen's 151,936 entries), even a
# masked one (-inf + inf is NaN, which torch's max takes). kernels/sampling.py does the same.
UNIFORM_BITS = 23


def uniform_noise(
    seeds: torch.Tensor, positions: torch.Tensor, num_cols: int, col_offset: int = 0
) -> torch.Tensor:
    """[B, num_cols] uniforms in (0, 1), a pure function of (seed, position, vocab index)."""
    return uniform_of_bits(noise_bits(seeds, positions, num_cols, col_offset))


def uniform_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) from 32-bit hashes held in int64 (see UNIFORM_BITS)."""
    return ((bits >> (32 - UNIFORM_BITS)).to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def _apply_filters(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Mask to -inf the tokens top-k, top-p and min-p exclude (logits already temperature-scaled)."""
    if st.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * st.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if st.any_top_k or st.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        drop = ranks >= st.top_k[:, None]
        if st.any_top_p:
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop |= (cum - sorted_logits.softmax(dim=-1)) >= st.top_p[:, None]  # keep the token crossing p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def _argmax(values: torch.Tensor) -> torch.Tensor:
    """values.argmax(-1). On CPU torch's argmax is a scalar loop: max(-1)'s indices, the same
    first maximum, cost a third (0.36 vs 1.0 ms at [16, 49152], one thread)."""
    return values.max(dim=-1).indices if values.device.type == "cpu" else values.argmax(dim=-1)


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64, NO_TOKEN for a row without a finite logit."""
    if logits.is_cuda and not (st.any_top_k or st.any_top_p or st.any_min_p):
        from minfer.kernels.sampling import gumbel_argmax

        return gumbel_argmax(logits, st.temperature, st.seeds, st.positions)
    tokens = _argmax(logits)  # the greedy rows' draw
    if not st.all_greedy:
        temperature = torch.where(st.temperature > 0, st.temperature, 1.0)
        scaled = _apply_filters(logits / temperature[:, None], st)
        gumbel = -torch.log(-torch.log(uniform_noise(st.seeds, st.positions, logits.shape[-1])))
        tokens = torch.where(st.temperature > 0, _argmax(scaled + gumbel), tokens)
    # The filters keep at least the largest logit and the noise is finite, so a row's winner
    # has a finite logit exactly when the row has one (with a NaN, max took the NaN).
    return mark_undrawable(tokens, logits.gather(1, tokens[:, None]).squeeze(1))


def filters_apply(params: SamplingParams) -> bool:
    """Whether top-k, top-p or min-p can change this request's draw (they need the whole row)."""
    return not params.greedy and (params.top_k > 0 or params.top_p < 1 or params.min_p > 0)


def best_of_shard(
    logits: torch.Tensor, st: SamplingTensors, col_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The winner of each row over a slice of the vocabulary (rows without filters): (vocabulary
    index [B] int64, value [B] float32), where the value is the raw logit for greedy rows and
    logit / T + Gumbel noise otherwise. The winner over the whole vocabulary is the slice winner
    of greatest value (lowest index on ties), and it is the token `sample` draws."""
    if logits.is_cuda:
        from minfer.kernels.sampling import gumbel_best

        cols, values = gumbel_best(logits, st.temperature, st.seeds, st.positions, col_offset)
        # a shard without a finite logit says NO_TOKEN; its -inf value loses the reduction
        return table_token(cols) + col_offset, values
    if st.all_greedy:
        values, cols = logits.max(dim=-1)
        return cols + col_offset, values
    temperature = torch.where(st.temperature > 0, st.temperature, 1.0)
    noise = uniform_noise(st.seeds, st.positions, logits.shape[-1], col_offset)
    perturbed = logits / temperature[:, None] + -torch.log(-torch.log(noise))
    perturbed = torch.where(st.temperature[:, None] > 0, perturbed, logits)
    values, cols = perturbed.max(dim=-1)
    return cols + col_offset, values
