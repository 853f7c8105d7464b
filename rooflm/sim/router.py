"""Which data-parallel replica a new request goes to.

  round-robin   in turn, blind to load;
  least-loaded  the replica with the fewest unfinished requests (ties: fewest outstanding
                prompt + output tokens, then the lowest index);
  prefix-aware  requests that share a prompt prefix go to the replica that served it
                first, so its prefix cache hits, unless that replica has more than
                `balance` x the least-loaded one's requests (plus a small slack), when the
                request goes to the least-loaded replica instead (SGLang's cache-aware
                router makes the same trade between hits and balance).
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

from rooflm.sim.replica import SimReplica

POLICIES = ("round-robin", "least-loaded", "prefix-aware")


class Router:
    def __init__(self, policy: str, balance: float = 1.5, slack: int = 4):
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.balance = balance
        self.slack = slack
        self._next = 0
        self._owner: dict[Hashable, int] = {}

    def pick(self, replicas: Sequence[SimReplica], prefix_key: Optional[Hashable] = None) -> int:
        if len(replicas) == 1:
            return 0
        if self.policy == "round-robin":
            index = self._next % len(replicas)
            self._next += 1
            return index
        least = min(range(len(replicas)),
                    key=lambda i: (replicas[i].num_unfinished, replicas[i].outstanding_tokens, i))
        if self.policy == "least-loaded" or prefix_key is None:
            return least
        owner = self._owner.get(prefix_key)
        if owner is not None:
            limit = self.balance * replicas[least].num_unfinished + self.slack
            if replicas[owner].num_unfinished <= limit:
                return owner
        self._owner[prefix_key] = least
        return least
