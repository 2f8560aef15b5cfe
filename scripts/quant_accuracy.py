"""Issue 17's accuracy check: --quantization paths against the float32-dequantized default.

For each method (gguf, int4, int8) on the default model (SmolLM2-135M-Instruct Q4_1):
  - mean |delta log-prob| per token: the float path answers 50 chat prompts greedily
    (48 tokens); each path then scores those same answers teacher-forced, and the
    log-probabilities of every answer token are compared with the float path's;
  - the fraction of 20 factual questions whose greedy answers (24 tokens) are identical.
Each method is measured twice: "decode" runs every row through the low-bit kernels (as a
decode step of a few requests does: int4/int8 linear layers, the int8 head), "served" as a
server runs it (prefill and large batches through the dense bfloat16 or float32 matrices).
Targets (issue 17): <= 0.05 nats per token, >= 90% identical.
    PYTHONPATH=. python3 scripts/quant_accuracy.py [--methods gguf int4 int8]
"""

from __future__ import annotations

import argparse
import time

import torch

from minfer import LLM, SamplingParams
from minfer.models.quantize import linear_layers

QUESTIONS = [
    "What is the capital of France?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in the solar system?",
    "What is the chemical symbol for gold?",
    "How many continents are there on Earth?",
    "What is the boiling point of water in Celsius?",
    "Who painted the Mona Lisa?",
    "What is the capital of Japan?",
    "What gas do plants absorb from the air?",
    "What is the square root of 81?",
    "Which ocean is the largest?",
    "Who was the first person to walk on the Moon?",
    "What is the longest river in Africa?",
    "What language is spoken in Brazil?",
    "How many legs does a spider have?",
    "What is the freezing point of water in Fahrenheit?",
    "Which element has the atomic number 1?",
    "What is the capital of Italy?",
    "Who developed the theory of relativity?",
    "What is the hardest natural substance?",
]
TOPICS = [
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "machine learning",
    "the water cycle",
    "compound interest",
    "the immune system",
    "plate tectonics",
    "the Roman Empire",
    "electric cars",
    "coffee brewing",
    "the stock market",
    "climate change",
    "the human heart",
    "volcanoes",
    "the internet",
    "honey bees",
    "jazz music",
    "the printing press",
    "solar panels",
    "chess openings",
    "the Great Wall of China",
    "vaccines",
    "recycling",
    "the Olympic Games",
    "DNA",
    "rainbows",
    "the moon landing",
    "bread baking",
    "earthquakes",
]
PROMPTS = [f"Explain {t} in two sentences." for t in TOPICS] + [
    f"Answer briefly: {q}" for q in QUESTIONS
]  # 50


def make_llm(method: str, all_low_bit: bool = False) -> LLM:
    llm = LLM(quantization=method, kv_cache_tokens=8192, cache="naive", cpu_threads=1)
    if all_low_bit:
        head = llm.engine.model.lm_head.low_bit
        kernels = [layer.low_bit for _, layer in linear_layers(llm.engine.model)]
        for kernel in kernels + ([head.low_bit] if head is not None else []):
            if kernel is not None:
                kernel.max_rows = 1 << 30
    return llm


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate_ids(
        [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts], params, False
    )
    return [o.token_ids for o in outs]


def answer_logprobs(llm: LLM, prompts: list[list[int]], answers: list[list[int]]) -> list[list[float]]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate_ids([p + a for p, a in zip(prompts, answers)], params, False)
    return [o.prompt_logprobs.logprobs[len(p) :] for o, p in zip(outs, prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["gguf", "int4", "int8"])
    parser.add_argument("--numerics", nargs="+", default=["decode", "served"], choices=["decode", "served"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = make_llm("none")
    prompts = [base.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    answers = greedy(base, PROMPTS, 48)
    base_lp = answer_logprobs(base, prompts, answers)
    base_facts = greedy(base, QUESTIONS, 24)
    base.shutdown()
    print(f"{'method':<14} {'mean |dlogp| nats/token':>24} {'max':>7} {'facts identical':>16}  seconds")
    for method, numerics in [(m, n) for m in args.methods for n in args.numerics]:
        start = time.perf_counter()
        llm = make_llm(method, numerics == "decode")
        lp = answer_logprobs(llm, prompts, answers)
        deltas = torch.tensor([abs(a - b) for xs, ys in zip(lp, base_lp) for a, b in zip(xs, ys)])
        facts = greedy(llm, QUESTIONS, 24)
        same = sum(a == b for a, b in zip(facts, base_facts))
        differ = [QUESTIONS[i] for i, (a, b) in enumerate(zip(facts, base_facts)) if a != b]
        llm.shutdown()
        print(
            f"{method + ' ' + numerics:<14} {deltas.mean().item():>24.4f} {deltas.max().item():>7.3f} "
            f"{same:>10}/{len(QUESTIONS)} ({100 * same / len(QUESTIONS):.0f}%)  {time.perf_counter() - start:.0f}"
        )
        print(f"  {len(deltas)} answer tokens over {len(PROMPTS)} prompts; answers that differ: {differ}")


if __name__ == "__main__":
    main()
