"""Fixtures shared by the model tests."""

from __future__ import annotations

import os

import pytest
import torch

from minfer.models.loader import default_model_path


@pytest.fixture(scope="session")
def default_reference():
    """transformers' float32 model of the embedded default GGUF. Dequantizing the file in
    transformers takes ~25 s on the CI machine, so the tests that compare against it share one."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()
