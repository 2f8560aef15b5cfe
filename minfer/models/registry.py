"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from minfer.models.llama import LlamaForCausalLM
from minfer.models.mistral import MistralForCausalLM
from minfer.models.mixtral import MixtralForCausalLM
from minfer.models.qwen2 import Qwen2ForCausalLM
from minfer.models.qwen3 import Qwen3ForCausalLM
from minfer.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


class UnsupportedModelError(ValueError):
    pass


def model_class_for(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    raise UnsupportedModelError(
        f"unsupported architecture {archs or '(none in config.json)'}; minfer supports {sorted(MODEL_CLASSES)}"
    )
