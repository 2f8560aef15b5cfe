"""A CPU engine's page table split as a GPU engine's is: kernels' table and host mirror apart.

On a CPU engine the two are one tensor, so a write that reaches one and not the other (a decode
step's device write is the step's own: engine/decode_inputs.py) cannot show; split, the KV check
after every step compares each running request's row in both (KVManager.check)."""

from __future__ import annotations


def split_mirror(llm) -> None:
    """Call before the engine's first step."""
    table = llm.engine.page_table
    table.slots_cpu = table.slots.clone()
