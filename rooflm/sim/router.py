"""The simulator routes with the server's own router (rooflm/dp/router.py), so a simulated
data-parallel layout makes the same choices the real one would.

The simulator names a prompt's prefix with one key (its prefix group, or its first
block's tokens) where the server hashes every block; one key is a one-block chain.
"""

from __future__ import annotations

from rooflm.dp.router import POLICIES, Router, canonical_policy

__all__ = ["POLICIES", "Router", "canonical_policy"]
