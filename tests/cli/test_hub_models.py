"""`minfer generate ORG/NAME`: Hugging Face ids resolve through the hub library's cache offline."""

from __future__ import annotations

from cli_harness import HUB_REPO_ID, assert_one_line_error, minfer

OFFLINE = {"HF_HUB_OFFLINE": "1"}


def _generate(model: str, *extra: str, env: dict) -> object:
    return minfer("generate", model, "--prompt", "Hello", "--max-tokens", "3", *extra, env=env)


def test_a_cached_hub_id_generates_offline(hub_cache):
    result = _generate(HUB_REPO_ID, "--download-dir", str(hub_cache), env=OFFLINE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "the tiny model printed nothing"


def test_an_uncached_hub_id_is_one_line(hub_cache):
    result = _generate("tiny-org/not-downloaded", "--download-dir", str(hub_cache), env=OFFLINE)
    assert_one_line_error(result, "'tiny-org/not-downloaded'", "cached", str(hub_cache))


def test_an_uncached_revision_is_one_line(hub_cache):
    result = _generate(HUB_REPO_ID, "--download-dir", str(hub_cache), "--revision", "v9", env=OFFLINE)
    assert_one_line_error(result, f"'{HUB_REPO_ID}@v9'", "cached")
