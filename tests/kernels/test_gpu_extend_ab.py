"""scripts/gpu_extend_ab.py's loading of two builds of the Gluon extend kernel side by side (the
timing needs a Hopper GPU; which build's code each launch runs is decided here, on any machine)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_extend_ab  # noqa: E402

KERNELS = ROOT / "minfer" / "kernels"
FILES = ("attention_extend_wgmma.py", "attention_extend_wgmma_consumer.py")


def _build(root: Path, consumer_suffix: str = "") -> Path:
    """A variant tree as ab_variants.py prepares one, with the repository's two kernel files."""
    kernels = root / "minfer" / "kernels"
    kernels.mkdir(parents=True)
    for name in FILES:
        shutil.copy(KERNELS / name, kernels / name)
    consumer = kernels / FILES[1]
    consumer.write_text(consumer.read_text() + consumer_suffix)
    return root


def test_builds_load_side_by_side_with_their_own_consumers(tmp_path):
    pytest.importorskip("triton.experimental.gluon")
    a = _build(tmp_path / "a")
    b = _build(tmp_path / "b", "\nBUILD_MARK = 'b'\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    gpu_extend_ab.load_build("ab_test_a", a, scratch)
    gpu_extend_ab.load_build("ab_test_b", b, scratch)
    kernel_a, kernel_b = sys.modules["extend_kernel_ab_test_a"], sys.modules["extend_kernel_ab_test_b"]
    consumer_b = sys.modules["extend_consumer_ab_test_b"]
    # Each kernel module runs its own build's consumer, read from that build's file.
    assert kernel_b._consumer is consumer_b._consumer
    assert kernel_a._consumer is sys.modules["extend_consumer_ab_test_a"]._consumer
    assert kernel_a._consumer is not kernel_b._consumer
    assert consumer_b.BUILD_MARK == "b" and not hasattr(
        sys.modules["extend_consumer_ab_test_a"], "BUILD_MARK"
    )
    assert Path(kernel_b.__file__).parent == scratch


def test_a_build_whose_kernel_no_longer_imports_the_consumer_is_refused(tmp_path):
    pytest.importorskip("triton.experimental.gluon")
    build = _build(tmp_path / "c")
    kernel = build / "minfer" / "kernels" / FILES[0]
    kernel.write_text(kernel.read_text().replace(gpu_extend_ab.CONSUMER_IMPORT, "from somewhere_else import"))
    with pytest.raises(SystemExit, match="no longer imports the consumer"):
        gpu_extend_ab.load_build("ab_test_c", build, tmp_path)
