"""The API process in front of an engine: one Python thread that admits requests and streams
tokens, in the order the work reaches it.

`rooflm serve` parses, validates and tokenizes each request and turns every token the engine
core sends back into an SSE chunk, all on one event loop. Measured on the H100 host
(benchmarks/results/serving-h100-20261123-s4/README.md, 1000 requests at once): 13.6 CPU-seconds
for 1000 requests and 204,250 streamed tokens, about 67 us per token with the per-request work
included, and the process kept a core busy at 512 streams. While it works through one step's
tokens, a new request waits to be admitted and the tokens behind it wait to be sent: queueing
that an engine-only simulation misses, which grows with the rate (the first fidelity run
under-predicted TTFT by 17% at the median at 16 req/s and by 52% at 80 req/s).

The model is a single server per replica (each replica is one `rooflm serve`): a request costs
request_s of its time, a streamed token token_s; a step's tokens queue behind all work booked
before them, a request only behind the work under way when it arrives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# CPU per streamed token, per-request work included (see the module docstring).
API_TOKEN_S = 67e-6


@dataclass(frozen=True)
class ApiCost:
    request_s: float = 0.0  # admitting one request (parse, validate, tokenize, hand to the core)
    token_s: float = 0.0  # one streamed token (detokenized text into an SSE chunk, sent)

    def __post_init__(self) -> None:
        if self.request_s < 0 or self.token_s < 0:
            raise ValueError(f"API process costs must be >= 0, got {self.request_s} s per request "
                             f"and {self.token_s} s per token")

    @property
    def active(self) -> bool:
        return self.request_s > 0 or self.token_s > 0


class ApiProcess:
    """One API process's timeline: the intervals it is busy, as booked.

    The simulation books a step's tokens when the host processes the step, which with async
    scheduling is before the step ends; a request arriving in between must not queue behind
    work that has not started yet. So the busy intervals are kept, and a request waits only
    for the interval it arrives in (and any that follow it without a gap).
    """

    def __init__(self, cost: ApiCost):
        self.cost = cost
        self.busy: deque[tuple[float, float]] = deque()  # (start, end), in booking order
        self.free_s = 0.0  # end of the last booked work
        self.busy_s = 0.0

    def admit(self, t: float) -> float:
        """A request reaching the process at t is handed to the engine core at the returned time."""
        while self.busy and self.busy[0][1] <= t:
            self.busy.popleft()  # finished before t: nothing to wait for
        start = t
        for s, e in self.busy:  # later intervals start no earlier (see send)
            if s > start:
                break
            start = max(start, e)
        end = start + self.cost.request_s
        self.busy_s += self.cost.request_s
        if self.cost.request_s:
            self._book(start, end)
        return end

    def send(self, t: float, n: int) -> list[float]:
        """n tokens of a step, out of the engine at t: when each reaches its client, in order."""
        start = max(t, self.free_s)
        step = self.cost.token_s
        if n and step:
            self._book(start, start + step * n)
        self.busy_s += step * n
        return [start + step * (i + 1) for i in range(n)]

    def _book(self, start: float, end: float) -> None:
        self.busy.append((start, end))
        if len(self.busy) > 1 and self.busy[-2][0] > start:  # a request slipped in before booked work
            self.busy = deque(sorted(self.busy))
        self.free_s = max(self.free_s, end)
