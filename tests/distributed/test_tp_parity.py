"""Tensor parallelism on CPU (gloo): `tp=2` generates exactly the tokens of `tp=1`.

Each case loads a tiny random model twice, in this process (tp=1) and as rank 0 of a two-rank
group whose rank 1 is a subprocess. Greedy and seeded sampling both must agree token for token
(the shards sum in another order, so logits differ in the last float32 bits; a flip would need
a near-tie, and these models have none).
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from tiny_models import save_tiny_model

from minfer import LLM, SamplingParams
from minfer.runner.ranks import free_local_addr

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7)


def prompts(n: int = 6, longest: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def run(path: str, batch: list[list[int]], **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, log_level="warning", **options)
    try:
        greedy = llm.generate(batch, GREEDY, use_tqdm=False)
        sampled = llm.generate(batch, SAMPLED, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.token_ids for o in greedy + sampled], llm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    made = {}

    def get(arch: str, kv_heads: int) -> str:
        if (arch, kv_heads) not in made:
            path = tmp_path_factory.mktemp(f"tp-{arch}-kv{kv_heads}")
            save_tiny_model(arch, path, num_key_value_heads=kv_heads)
            made[arch, kv_heads] = str(path)
        return made[arch, kv_heads]

    return get


@pytest.mark.parametrize(
    "arch,kv_heads", [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("mistral", 2), ("llama", 1), ("qwen3", 1)]
)
def test_tp2_matches_tp1(model_dir, arch, kv_heads):
    """kv_heads=2: one KV head per rank; kv_heads=1: the KV head is replicated on both ranks."""
    path, batch = model_dir(arch, kv_heads), prompts()
    expected, _ = run(path, batch)
    got, llm = run(path, batch, tp=2)
    assert llm.engine.num_kv_heads == 1 and llm.engine.tp.size == 2
    assert got == expected


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_tp2_matches_tp1_under_preemption_and_chunking(model_dir, kv_cache_dtype):
    """A KV pool too small for the batch and 16-token prefill chunks: the ranks' schedulers must
    preempt and chunk alike (and with an fp8 cache, each rank quantizes its heads alike)."""
    path, batch = model_dir("llama", 1), prompts(n=8, longest=60, seed=1)
    options = {
        "kv_cache_tokens": 160,
        "page_size": 4,
        "chunked_prefill_size": 16,
        "kv_cache_dtype": kv_cache_dtype,
    }
    expected, reference = run(path, batch, **options)
    assert reference.scheduler.counters.preemptions > 0
    got, llm = run(path, batch, tp=2, **options)
    assert llm.scheduler.counters.preemptions == reference.scheduler.counters.preemptions
    assert got == expected


def test_abort_reaches_every_rank(model_dir):
    """Requests added and aborted between steps (as the serving loop does): rank 1 replays the
    same changes, so the tokens stay identical (rank 1 checks each step's tokens against rank 0)."""
    path = model_dir("mistral", 2)

    def drive(llm: LLM) -> list[list[int]]:
        runner = llm.runner
        reqs = [runner.add(p, GREEDY.__copy__()) for p in prompts(4)]
        for step in range(12):
            if step == 3:
                runner.abort(reqs[1].uid)
            if step == 5:
                reqs.append(runner.add(prompts(1, seed=9)[0], SAMPLED.__copy__()))
            runner.step()
        runner.drain()
        llm.shutdown()
        return [r.output_ids for r in reqs]

    expected = drive(LLM(path, log_level="warning"))
    assert drive(LLM(path, tp=2, log_level="warning")) == expected


def test_two_nodes_same_code_path(model_dir, tmp_path):
    """nnodes=2 on one host: node 1 is `LLM(..., node_rank=1)` in another process, which serves
    its rank until node 0 shuts down and then exits 0."""
    path, batch = model_dir("qwen3", 2), prompts()
    expected, _ = run(path, batch)
    addr = free_local_addr()
    code = (
        f"from minfer import LLM; LLM({path!r}, tp=2, nnodes=2, node_rank=1, dist_init_addr={addr!r}, "
        f"log_level='warning')"
    )
    node1 = subprocess.Popen([sys.executable, "-c", code])
    try:
        got, _ = run(path, batch, tp=2, nnodes=2, node_rank=0, dist_init_addr=addr)
        assert node1.wait(timeout=30) == 0
    finally:
        node1.kill()
    assert got == expected


def test_several_tp_jobs_in_one_process_free_their_groups(model_dir):
    """Two TP jobs in one fresh process: each job's gloo groups and rendezvous store are freed
    with the job (their native threads gone), not kept until interpreter exit, where their
    destruction now and then aborted the process. And torch, which prefixes '[rank0]: ' to
    traceback lines at every process-group init, must not make it '[rank0]: [rank0]: '."""
    path = model_dir("llama", 2)
    code = (
        f"import gc, os\n"
        f"from minfer import LLM\n"
        f"for _ in range(2):\n"
        f"    LLM({path!r}, tp=2, log_level='warning').shutdown()\n"
        f"    gc.collect()\n"
        f"    names = []\n"
        f"    for t in os.listdir('/proc/self/task'):\n"
        f"        try:\n"
        f"            names.append(open(f'/proc/self/task/{{t}}/comm').read().strip())\n"
        f"        except FileNotFoundError:\n"
        f"            pass  # a thread that ended meanwhile\n"
        f"    print('group threads left:', sorted(n for n in names if 'gloo' in n or 'tcpstore' in n))\n"
        f"raise RuntimeError('after two TP jobs')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.count("group threads left: []") == 2, proc.stdout
    assert "[rank0]: RuntimeError: after two TP jobs" in proc.stderr, proc.stderr[-2000:]
    assert "[rank0]: [rank0]:" not in proc.stderr


def test_vocab_parallel_draw_matches_tp1(tmp_path):
    """Greedy and temperature-only rows are drawn shard by shard (no logits gathered), with a
    vocabulary that does not split evenly (the last shard is padded); a batch with logprobs
    gathers the rows instead. Both give tp=1's tokens."""
    save_tiny_model("qwen3", tmp_path, num_key_value_heads=2, vocab_size=259)
    batch = prompts(n=5, seed=3)
    plain = [SamplingParams(temperature=t, max_tokens=10, ignore_eos=True, seed=3) for t in (0.0, 0.8, 1.1)]
    with_logprobs = SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, seed=5, logprobs=2)

    def drive(llm: LLM) -> list:
        try:
            out = [llm.generate(batch, p, use_tqdm=False) for p in plain]
            out.append(llm.generate(batch, with_logprobs, use_tqdm=False))
            return [o.token_ids for outs in out for o in outs], llm.engine.vocab_parallel_draws
        finally:
            llm.shutdown()

    expected, _ = drive(LLM(str(tmp_path), log_level="warning"))
    got, draws = drive(LLM(str(tmp_path), tp=2, log_level="warning"))
    assert draws > 0
    assert got == expected


def test_tp2_applies_allowed_token_ids_and_bad_words_like_tp1(model_dir):
    """The token masks (a bad word's tail matched against the token table) under tp=2: the
    vocabulary is split across ranks, the masked row gathered whole."""
    path, batch = model_dir("llama", 2), prompts(n=2, longest=12)

    def tokens(**options) -> list[list[int]]:
        llm = LLM(path, log_level="warning", **options)
        try:
            base = llm.generate(batch, GREEDY, use_tqdm=False)
            head, tail = base[0].token_ids[:2]
            limited = [
                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words_ids=[[head, tail]]),
                SamplingParams(
                    temperature=1.0, seed=4, max_tokens=8, ignore_eos=True, allowed_token_ids=[3, 4, 5]
                ),
            ]
            return [o.token_ids for o in base + llm.generate(batch, limited, use_tqdm=False)]
        finally:
            llm.shutdown()

    expected = tokens()
    assert expected[2][0] == expected[0][0] and expected[2][1] != expected[0][1]
    assert set(expected[3]) <= {3, 4, 5}
    assert tokens(tp=2) == expected
