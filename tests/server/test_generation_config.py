"""generation_config.json: its end-of-turn ids end answers, and its sampling values are the
defaults of requests that leave them unset (offline, the OpenAI endpoints and /generate), unless
`--generation-config none`; a folder given instead supplies them."""

from __future__ import annotations

import json

import pytest
from server_harness import Server
from tiny_models import save_tiny_model

from minfer import LLM, SamplingParams
from minfer.config import ModelNotFoundError
from minfer.models.generation_config import generation_settings, sampling_defaults

PROMPT = [5, 17, 42, 99, 3]


def write_generation_config(folder, **fields) -> None:
    path = folder / "generation_config.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **fields}))


def test_the_file_read_as_a_maker_means_it(tmp_path):
    assert sampling_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    # do_sample false: transformers ignores the sampling values, so do we
    assert sampling_defaults({"temperature": 0.6, "do_sample": False}) == {}
    # out of range, not a number, or not finite: left out, the rest kept
    assert sampling_defaults(
        {"top_p": 1.5, "top_k": "20", "min_p": float("nan"), "repetition_penalty": 1.1}
    ) == {"repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(
        '{"eos_token_id": [2, 7], "temperature": 0.5'
    )  # cut short
    assert generation_settings(str(tmp_path), "auto") == (set(), {})  # unreadable: ignored
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7], "temperature": 0.5}')
    other = tmp_path / "other"
    other.mkdir()
    write_generation_config(other, eos_token_id=9, top_k=3)
    assert generation_settings(str(tmp_path), "auto") == ({2, 7}, {"temperature": 0.5})
    assert generation_settings(str(tmp_path), "none") == ({2, 7}, {})  # the turn still ends at 7
    assert generation_settings(str(tmp_path), "vllm") == ({2, 7}, {})  # vLLM's spelling of none
    assert generation_settings(str(tmp_path), str(other)) == ({2, 7, 9}, {"top_k": 3})
    assert generation_settings(str(tmp_path / "model.gguf"), "auto") == (set(), {})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama whose generation_config.json says top_k 1 (greedy) and ends turns at the
    fourth token its greedy answer to PROMPT draws."""
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model("llama", path)
    llm = LLM(str(path), kv_cache_tokens=512, log_level="warning", generation_config="none")
    try:
        greedy = llm.generate_ids([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    finally:
        llm.shutdown()
    answer = greedy[0].token_ids
    stop = answer[3]
    assert stop not in answer[:3] and stop != 2  # the tiny config's own eos
    write_generation_config(path, top_k=1, eos_token_id=[2, stop])
    return path, answer[: answer.index(stop) + 1]


def test_offline_defaults_and_end_of_turn(model, tmp_path):
    path, greedy = model
    llm = LLM(str(path), kv_cache_tokens=512, log_level="warning")
    try:
        assert llm.default_sampling_params().top_k == 1
        out = llm.generate_ids([PROMPT] * 3)[0]  # no SamplingParams: the file's top_k 1
        assert out.token_ids == greedy[: len(out.token_ids)]
        long = SamplingParams(temperature=0, max_tokens=12)
        out = llm.generate_ids([PROMPT], long)[0]
        assert (out.token_ids, out.finish_reason) == (greedy, "stop")  # ended at the file's eos
    finally:
        llm.shutdown()
    with pytest.raises(ModelNotFoundError, match="--generation-config"):
        LLM(str(path), generation_config=str(tmp_path / "missing"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    path, greedy = model
    srv = Server(
        [str(path), "--served-model-name", "tiny", "--kv-cache-tokens", "512"],
        tmp_path_factory.mktemp("logs") / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    yield srv, greedy
    srv.stop()


def test_served_requests_take_the_defaults_they_leave_unset(server):
    srv, greedy = server
    assert "generation_config.json's top_k=1" in srv.output()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "seed": 1}
    for temperature in (None, 1.5):  # unset top_k: the file's 1, whatever the temperature
        sampling = {"max_new_tokens": 12, "sampling_seed": 1}
        if temperature is not None:
            sampling["temperature"] = temperature
        out = srv.post("/generate", {"input_ids": PROMPT, "sampling_params": sampling}).json()
        assert out["output_ids"] == greedy and out["meta_info"]["finish_reason"]["type"] == "stop"
    choice = srv.post("/v1/completions", {**body, "temperature": 1.5}).json()
    assert choice["choices"][0]["finish_reason"] == "stop"
    assert choice["usage"]["completion_tokens"] == len(greedy)
    # a request that sets top_k gets its own: over a tiny random model's near-flat distribution,
    # seeded draws from the whole vocabulary leave the greedy answer at once
    drawn = [
        srv.post(
            "/generate",
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 4, "top_k": -1, "sampling_seed": seed},
            },
        ).json()["output_ids"]
        for seed in range(3)
    ]
    assert any(ids != greedy[:4] for ids in drawn)
