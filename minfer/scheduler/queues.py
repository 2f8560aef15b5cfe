"""The scheduler's request queues, and the membership rules the invariant check enforces.

  waiting     accepted, not holding KV (new, or preempted with their tokens kept)
  prefilling  holding KV, prompt not fully computed yet (chunked prefill)
  running     prompt computed; one token per decode step
Every known request (`by_uid`) is in exactly one of them until it finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minfer.core import Req
from minfer.kvcache.prefix_cache import KVInvariantError


@dataclass
class RequestQueues:
    waiting: deque[Req] = field(default_factory=deque)
    prefilling: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    by_uid: dict[int, Req] = field(default_factory=dict)

    @property
    def holders(self) -> list[Req]:
        """The requests holding a page-table row and KV pages."""
        return self.prefilling + self.running

    def remove(self, req: Req) -> None:
        """Take a request out of whichever queue holds it (it stays in by_uid)."""
        for queue in (self.running, self.prefilling, self.waiting):
            if req in queue:
                queue.remove(req)
                return

    def check(self) -> None:
        """Each known request in exactly one queue; waiting ones hold no row."""
        queued = list(self.waiting) + self.holders
        if len({id(r) for r in queued}) != len(queued) or {r.uid for r in queued} != set(self.by_uid):
            raise KVInvariantError("a request is in two queues, or known but in none")
        if any(r.table_idx >= 0 for r in self.waiting):
            raise KVInvariantError("a waiting request holds a page-table row")
