"""CPU cost of the scheduler's part of a decode step at batch 256 (no forward pass): schedule,
allocate slots, build sampling tensors, advance the lengths. Run from the repo root:

    PYTHONPATH=$PWD:$PWD/tests python scripts/cpu_scheduler_cost.py
"""

import cProfile
import pstats
import tempfile
import time

from tiny_models import save_tiny_model

from minfer import LLM
from minfer.bench.offline import make_workload
from minfer.engine.sampler import SamplingTensors

d = tempfile.mkdtemp()
save_tiny_model("qwen3", d, vocab_size=10001, max_position_embeddings=4096)
llm = LLM(d, kv_cache_tokens=600000, log_level="warning")
s = llm.scheduler
prompts, params = make_workload()
for p, sp in zip(prompts, params):
    s.add_request(p, sp)
while s.waiting or s.prefilling:
    b = s.prefill.plan()
    b.out_loc = s.kv.allocate(b.reqs, b.extend_lens)
    s.advance(b)
pr = cProfile.Profile()
pr.enable()
t = time.perf_counter()
n = 50
for _ in range(n):
    b = s.decode.plan()
    b.out_loc = s.kv.allocate(b.reqs, b.extend_lens)
    st = SamplingTensors.build(
        [r.params for r in b.reqs],
        [r.seed for r in b.reqs],
        [r.device_len for r in b.reqs],
        10001,
        llm.engine.device,
    )
    s.advance(b)
pr.disable()
print(
    f"decode batch {b.size}: scheduler CPU {1e3 * (time.perf_counter() - t) / n:.2f} ms/step (schedule+allocate+sampling tensors+advance)"
)
pstats.Stats(pr).sort_stats("tottime").print_stats(8)
