"""Property-based fuzzing with schemathesis: the server's own /openapi.json (every operation) and
OpenAI's published spec (completions and chat). No answer may be a 5xx, and none may violate the
schema the server itself publishes. Bounded: a few hundred examples in all."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from server_harness import Server

OPENAI_SPEC = Path(__file__).resolve().parents[3] / "shared" / "openai-openapi.yaml"
if not OPENAI_SPEC.exists():
    OPENAI_SPEC = Path("/work/shared/openai-openapi.yaml")
CHECKS = [not_a_server_error, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    # A short context keeps every generated request quick (chat without max_tokens fills it).
    srv = Server(
        [tiny_chat_model, "--kv-cache-tokens", "2048", "--max-model-len", "64", "--max-batch-prompts", "4"],
        tmp_path_factory.mktemp("logs") / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    yield srv
    srv.stop()


def fuzz(operation, base_url: str, max_examples: int, own_operation=None) -> None:
    """Run `max_examples` generated requests of one operation; each answer must not be a 5xx and
    must match the server's own schema (`own_operation` for a request generated from OpenAI's
    spec: what the server publishes is what it must keep)."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def run(case):
        response = case.call(base_url=base_url, timeout=60)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if own_operation is None:
            case.validate_response(response, checks=CHECKS)
        else:
            own_operation.validate_response(response)

    run()


def test_own_openapi(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    for operation in operations:
        fuzz(operation, server.url, max_examples=12)
    assert httpx.get(server.url + "/health").status_code == 200


def test_openai_spec_completions_and_chat(server):
    spec = schemathesis.openapi.from_path(OPENAI_SPEC).include(
        path_regex=r"^/(chat/)?completions$", method="POST"
    )
    own = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in spec.get_all_operations()]
    assert len(operations) == 2
    for operation in operations:
        fuzz(
            operation, server.url + "/v1", max_examples=40, own_operation=own["/v1" + operation.path]["POST"]
        )
    assert httpx.get(server.url + "/health").status_code == 200
