"""minfer: a compact, fast LLM serving engine."""

from minfer.core import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name):
    # Imported lazily: `import minfer` stays light for the API server and the tokenizer worker.
    if name == "LLM":
        from minfer.llm import LLM

        return LLM
    raise AttributeError(name)
