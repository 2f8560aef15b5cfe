"""CPU cost of the host's parts of a batch-1 decode step, one at a time (no GPU needed: the
same Python runs on a GPU host, where each also stages its tensors to the device).

    PYTHONPATH=$PWD:$PWD/tests python3 scripts/cpu_host_step_parts.py

A tiny Qwen3-shaped model decodes one request; then each part is timed alone, 2000 times.
"""

import tempfile
import time

import torch
from tiny_models import save_tiny_model

from minfer import LLM, SamplingParams
from minfer.engine.sampler import SamplingTensors
from minfer.kvcache.page_table import runs_of_positions


def timeit(label: str, fn, n: int = 2000) -> None:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    print(f"{label:40s} {1e6 * (time.perf_counter() - start) / n:7.1f} us", flush=True)


def main() -> None:
    torch.set_num_threads(1)  # a GPU engine's host thread count (device.set_gpu_host_threads)
    path = tempfile.mkdtemp()
    save_tiny_model("qwen3", path, vocab_size=10001, max_position_embeddings=4096)
    llm = LLM(path, kv_cache_tokens=8192, log_level="warning")
    sched = llm.scheduler
    sched.add_request(list(range(1, 100)), SamplingParams(temperature=0.6, max_tokens=3000, ignore_eos=True))
    for _ in range(5):
        sched.step()
    req, kv = sched.running[0], sched.kv

    def allocate_and_free():
        kv.allocator.free(kv.allocate([req], [1]))

    timeit("decode.plan", sched.decode.plan)
    timeit(
        "runs_of_positions (1 position)", lambda: runs_of_positions([req.table_idx], [req.cached_len], [1])
    )
    timeit(
        "write_slots (1 slot, CPU table)",
        lambda: kv.page_table.write_slots([req.table_idx], [req.cached_len], [5]),
    )
    timeit("KVManager.allocate + free (1 token)", allocate_and_free)
    timeit(
        "SamplingTensors.build (1 request)",
        lambda: SamplingTensors.build([req.params], [req.seed], [req.device_len], 10001, llm.engine.device),
    )
    cache = llm.engine.sampling_tensors
    timeit("SamplingTensorCache.get (1, same request)", lambda: cache.get([req], 10001, llm.engine.device))


if __name__ == "__main__":
    main()
