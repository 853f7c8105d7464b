"""HMAC on the engine-core protocol's frames, for sockets another host can reach.

On one host the API process and its cores talk over ipc:// files in a mode-0700 directory:
only this user can connect, and frames go as they are. A core on another node of a Ray
cluster listens on tcp://, where anyone who can reach the port could send an AddRequests.
There every frame carries HMAC-SHA256 over its bytes, under a 32-byte secret the API
process draws for that core and hands it through Ray (never over the socket itself). A frame
whose tag does not match is dropped unread and counted; the payload stays msgpack.

Each frame also carries the sender's sequence number (8 bytes, in the clear, under the
tag); the receiver takes only numbers above the last it took, so a frame recorded from the
wire and sent again (replayed) is dropped too. Gaps are allowed: a send that failed after
its number was drawn costs nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import Optional

logger = logging.getLogger(__name__)

TAG_BYTES = 32  # SHA-256
SEQUENCE_BYTES = 8
SECRET_BYTES = 32


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


class FrameAuth:
    """Seals outgoing frames and opens incoming ones for one end of one socket pair.

    secret None: frames pass unchanged (ipc:// on one host)."""

    def __init__(self, secret: Optional[bytes]):
        self.secret = secret
        self.num_dropped = 0  # frames refused: wrong tag, too short, or replayed
        self._sent = 0
        self._last_received = -1

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def seal(self, payload: bytes) -> bytes:
        if self.secret is None:
            return payload
        sequence = self._sent.to_bytes(SEQUENCE_BYTES, "little")
        self._sent += 1
        return payload + sequence + self._tag(sequence, payload)

    def open(self, frame: bytes) -> Optional[bytes]:
        """The payload, or None for a frame that fails the check (counted, logged)."""
        if self.secret is None:
            return frame
        trailer = SEQUENCE_BYTES + TAG_BYTES
        if len(frame) >= trailer:
            payload, sequence, tag = frame[:-trailer], frame[-trailer:-TAG_BYTES], frame[-TAG_BYTES:]
            number = int.from_bytes(sequence, "little")
            if hmac.compare_digest(tag, self._tag(sequence, payload)) and number > self._last_received:
                self._last_received = number
                return payload
        self.num_dropped += 1
        logger.warning("dropped a frame that failed authentication (%d bytes; %d dropped so far)",
                       len(frame), self.num_dropped)
        return None

    def _tag(self, sequence: bytes, payload: bytes) -> bytes:
        mac = hmac.new(self.secret, sequence, hashlib.sha256)
        mac.update(payload)
        return mac.digest()
