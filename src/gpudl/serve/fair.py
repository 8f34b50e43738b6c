"""Who the model serves next: requests wait per client, and the next to start is the head of the
waiting client that has had the least service so far, by a virtual token counter (VTC: Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024).

A client is charged for what the model does for it, as it happens: rows for a classifier; for a GPT
each prompt token 1 and each generated token 2 (the paper's weights: a decoding step costs a
sequence more than its share of a prefill), charged while the sequence runs, so a client holding
many decode slots falls behind one that holds few. A client that starts waiting again is lifted to
the least counter among those waiting (or, when none waits, to the counter of the last client
served): service a client did not ask for while it was idle is not banked as credit against the
clients that kept the server busy. So a light client waits for about one request of each other
waiting client, however many the heavy one has queued.

Within a client, requests start by `priority` (lower first, as vLLM's), then by arrival: a client
orders its own share, and no priority lets it take another client's.

Not thread-safe: the engine calls it under its lock.

>>> from types import SimpleNamespace as R
>>> q = FairQueue()
>>> for name, client in (("h1", "heavy"), ("h2", "heavy"), ("h3", "heavy"), ("l1", "light")):
...     q.push(R(name=name, client=client, priority=0, units=1))
>>> order = []
>>> while q:
...     r = q.pop(); q.charge(r.client, r.units); order.append(r.name)
>>> order
['h1', 'l1', 'h2', 'h3']
"""

from __future__ import annotations

import bisect
import itertools

PROMPT_WEIGHT = 1.0     # VTC's charge per prompt token (GPT)
OUTPUT_WEIGHT = 2.0     # VTC's charge per generated token (GPT)
MEMORY = 4096           # idle clients' counters kept at most (tenant names must not grow memory without bound)


def _order(request) -> tuple[int, int]:
    return request.order


class FairQueue:
    """Requests waiting for the model, per client. Each request has `client` (str), `priority`
    (int, lower first) and `units` (its cost: rows, or 1 request); `push` gives it `order`."""

    def __init__(self):
        self._waiting: dict[str, list] = {}    # client -> its requests in (priority, arrival) order
        self._units: dict[str, int] = {}       # client -> units it has waiting
        self.counters: dict[str, float] = {}   # client -> service received (VTC)
        self._arrivals = itertools.count()
        self._last = ""                        # the client served last
        self.length = self.units = 0           # requests and units waiting, all clients

    def __len__(self) -> int:
        return self.length

    def push(self, request) -> None:
        queue = self._waiting.get(request.client)
        if queue is None:
            self._lift(request.client)
            queue = self._waiting[request.client] = []
            self._units[request.client] = 0
        request.order = (request.priority, next(self._arrivals))
        bisect.insort(queue, request, key=_order)
        self._units[request.client] += request.units
        self.length += 1
        self.units += request.units

    def head(self):
        """The request that starts next, or None: the least-served waiting client's first
        (ties: the client whose first request came earliest)."""
        if not self._waiting:
            return None
        client = min(self._waiting, key=lambda c: (self.counters[c], self._waiting[c][0].order[1]))
        return self._waiting[client][0]

    def pop(self):
        """Take the request that starts next (see `head`); the caller charges what it costs."""
        request = self.head()
        self._last = request.client
        del self._waiting[request.client][0]
        self._gone(request)
        return request

    def remove(self, request) -> bool:
        """Take `request` out if it is still waiting (its caller left, or its deadline passed)."""
        queue = self._waiting.get(request.client)
        if not queue or getattr(request, "order", None) is None:
            return False
        i = bisect.bisect_left(queue, request.order, key=_order)
        if i == len(queue) or queue[i] is not request:
            return False
        del queue[i]
        self._gone(request)
        return True

    def charge(self, client: str, amount: float) -> None:
        """Count service the model gave `client` (at start, and per token while a GPT sequence runs)."""
        if client not in self.counters:  # forgotten while idle (MEMORY): as if lifted now
            self.counters[client] = self._floor()
        self.counters[client] += amount

    def ahead(self, client: str, units: int) -> int:
        """Units that would start before a request of `client` costing `units`, were it queued now:
        all its client's own, and from every other waiting client as many units as those plus its
        own (round robin: what VTC gives clients whose requests cost alike). Its priority is not
        counted: a request that jumps its client's queue delays that client's own by as much, and
        they were admitted on the promise of a wait."""
        own = self._units.get(client, 0)
        others = sum(min(n, own + units) for c, n in self._units.items() if c != client)
        return own + others

    def __iter__(self):
        """Every waiting request, in no particular order."""
        return itertools.chain.from_iterable(list(q) for q in self._waiting.values())

    def _gone(self, request) -> None:
        client = request.client
        self._units[client] -= request.units
        self.length -= 1
        self.units -= request.units
        if not self._waiting[client]:
            del self._waiting[client], self._units[client]

    def _floor(self) -> float:
        """Where a client that starts waiting is lifted to: the least counter among the waiting, or
        when none waits, the current counter of the client served last (as the VTC paper has it)."""
        return min((self.counters[c] for c in self._waiting), default=self.counters.get(self._last, 0.0))

    def _lift(self, client: str) -> None:
        floor = self._floor()
        self.counters[client] = max(self.counters.get(client, 0.0), floor)
        if len(self.counters) > MEMORY:  # forget idle clients a lift would raise anyway, then any idle one
            keep = {c: v for c, v in self.counters.items() if c in self._waiting or c == client or v > floor}
            if len(keep) > MEMORY:
                keep = {c: v for c, v in keep.items() if c in self._waiting or c == client}
            self.counters = keep
