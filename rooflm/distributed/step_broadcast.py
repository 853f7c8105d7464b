"""A step's description, from rank 0 to the workers, as one int64 tensor.

The scheduler runs once, on rank 0. What a worker needs to run the same forward is what the
model runner turns a SchedulerOutput into: input ids, positions, slot mapping, query starts,
sequence lengths, block tables, the rows whose logits are computed, the pending tokens (ids
still on the device, from the previous step's samples), prompt-logprob spans and the block
operations (swaps, copy-on-write). All of it is integers: rank 0 packs them into one int64
tensor behind a 16-entry header of counts and broadcasts it over the host (gloo) group;
the header goes first so that the worker can size its receive buffer (two broadcasts, one
message). Nothing is pickled. Each worker then copies the tensors to its own device
exactly as rank 0 does, so every rank launches the same kernels in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rooflm.distributed.group import TPGroup

HEADER_LEN = 16
OP_STEP, OP_STOP, OP_FINISH = 0, 1, 2
# What receive() returns for OP_FINISH: pipeline parallelism with batches in flight, where rank 0
# finishes its oldest batch (the last stage's rows back, the LM head, the sampled ids) later than
# it launched it; stage 0's other TP ranks do the same then (distributed/pipeline.py).
FINISH = "finish"


@dataclass
class StepPacket:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, W] int32
    logits_indices: list[int]
    max_query_len: int
    num_decodes: int
    pending_positions: list[int] = field(default_factory=list)  # packed index of each pending id
    pending_rows: list[int] = field(default_factory=list)  # its row in the previous step's samples
    prompt_logprob_spans: list[tuple[int, int]] = field(default_factory=list)  # (packed index, count)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # --enable-lora: each token's adapter slot (empty: no token under an adapter), and the
    # adapters rank 0 put into slots this step, (slot, lora_int_id, name, path): each worker
    # reads the adapter and writes the same slot (its own shard of it).
    lora_token_slots: list[int] = field(default_factory=list)
    lora_writes: list[tuple[int, int, str, str]] = field(default_factory=list)

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        num_seqs, width = self.block_tables.shape
        writes = _encode_writes(self.lora_writes)
        header = torch.tensor(
            [OP_STEP, self.input_ids.numel(), num_seqs, width, len(self.logits_indices),
             len(self.pending_positions), len(self.prompt_logprob_spans), len(self.blocks_to_swap_out),
             len(self.blocks_to_swap_in), len(self.blocks_to_copy), self.max_query_len,
             self.num_decodes, len(self.lora_token_slots), len(writes)]
            + [0] * (HEADER_LEN - 14), dtype=torch.int64)
        tail = (self.logits_indices + self.pending_positions + self.pending_rows
                + _flat(self.prompt_logprob_spans) + _flat(self.blocks_to_swap_out)
                + _flat(self.blocks_to_swap_in) + _flat(self.blocks_to_copy) + list(self.lora_token_slots) + writes)
        # numpy, not torch.cat/.long(): torch's CPU ops run on its intra-op thread pool, and with
        # the workers' pools beside it on the host a 50k-int cat took 2.5 ms (H200 x2 cProfile).
        payload = np.concatenate([self.input_ids.numpy(), self.positions.numpy(), self.slot_mapping.numpy(),
                                  self.query_start_loc.numpy(), self.seq_lens.numpy(),
                                  self.block_tables.numpy().reshape(-1), np.asarray(tail, dtype=np.int64)],
                                 dtype=np.int64)
        return header, torch.from_numpy(payload)

    @classmethod
    def unpack(cls, header: list[int], payload: torch.Tensor) -> "StepPacket":
        _, tokens, num_seqs, width, logits, pending, spans, swap_out, swap_in, copies, max_q, decodes = header[:12]
        lora_tokens, lora_writes = header[12:14]
        sizes = [tokens, tokens, tokens, num_seqs + 1, num_seqs, num_seqs * width]
        values = payload.numpy()
        parts = np.split(values[:sum(sizes)], np.cumsum(sizes)[:-1])
        tail = values[sum(sizes):].tolist()
        taken = 0

        def take(n: int) -> list[int]:
            nonlocal taken
            taken += n
            return tail[taken - n:taken]

        return cls(input_ids=torch.from_numpy(parts[0]), positions=torch.from_numpy(parts[1]),
                   slot_mapping=torch.from_numpy(parts[2]), query_start_loc=_int32(parts[3]),
                   seq_lens=_int32(parts[4]), block_tables=_int32(parts[5]).reshape(num_seqs, width),
                   logits_indices=take(logits),
                   max_query_len=max_q, num_decodes=decodes, pending_positions=take(pending),
                   pending_rows=take(pending), prompt_logprob_spans=_pairs(take(2 * spans)),
                   blocks_to_swap_out=_pairs(take(2 * swap_out)), blocks_to_swap_in=_pairs(take(2 * swap_in)),
                   blocks_to_copy=_pairs(take(2 * copies)), lora_token_slots=take(lora_tokens),
                   lora_writes=_decode_writes(take(lora_writes)))


def payload_size(header: list[int]) -> int:
    """Int64s in the payload a header announces (what pack writes after it)."""
    tokens, num_seqs, width, logits, pending = header[1:6]
    return (3 * tokens + 2 * num_seqs + 1 + num_seqs * width + logits + 2 * pending + 2 * sum(header[6:10])
            + header[12] + header[13])


def _encode_writes(writes: list[tuple[int, int, str, str]]) -> list[int]:
    """(slot, id, name, path) each as slot, id, the names' byte counts, then their UTF-8 bytes."""
    out: list[int] = []
    for slot, lora_id, name, path in writes:
        name_b, path_b = name.encode(), path.encode()
        out += [slot, lora_id, len(name_b), len(path_b), *name_b, *path_b]
    return out


def _decode_writes(values: list[int]) -> list[tuple[int, int, str, str]]:
    writes, i = [], 0
    while i < len(values):
        slot, lora_id, n_name, n_path = values[i:i + 4]
        i += 4
        name = bytes(values[i:i + n_name]).decode()
        path = bytes(values[i + n_name:i + n_name + n_path]).decode()
        i += n_name + n_path
        writes.append((slot, lora_id, name, path))
    return writes


def _int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.int32))


def _flat(pairs: list[tuple[int, int]]) -> list[int]:
    return [v for pair in pairs for v in pair]


def _pairs(values: list[int]) -> list[tuple[int, int]]:
    return list(zip(values[0::2], values[1::2]))


class StepChannel:
    """Rank 0 sends, the workers receive; both over the group's host (gloo) group.

    A gloo broadcast returns on the root only once every receiver has posted its receive
    (measured: a root whose receiver posts 20 ms late returns after 20 ms, at any size), so a
    blocking send would make rank 0 wait, each step, for the workers to finish launching the
    step before; rank 0's host work and theirs would add up instead of overlapping. So send()
    queues the broadcasts and returns; the next send (or stop) first waits for the previous
    one, which bounds rank 0's lead to one step and keeps its tensors alive until delivered."""

    def __init__(self, tp: TPGroup):
        self.tp = tp
        self._in_flight: list = []  # the last send's Work handles and the tensors they read

    def send(self, packet: StepPacket) -> None:
        header, payload = packet.pack()
        self.flush()
        works = [self.tp.broadcast_host_async(header), self.tp.broadcast_host_async(payload)]
        self._in_flight = [works, header, payload]

    def flush(self) -> None:
        """Wait until the last send reached every worker (raises if the group broke)."""
        if self._in_flight:
            works, self._in_flight = self._in_flight[0], []
            for work in works:
                if work is not None:
                    work.wait()

    def send_finish(self) -> None:
        """Tell the workers that rank 0 finishes its oldest batch in flight now."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = OP_FINISH
        self.flush()
        self._in_flight = [[self.tp.broadcast_host_async(header)], header]

    def send_stop(self) -> None:
        self.flush()
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = OP_STOP
        self.tp.broadcast_host(header)

    def receive(self):
        """The next step (a StepPacket), FINISH, or None when rank 0 stops the group."""
        header = self.tp.broadcast_host(torch.empty(HEADER_LEN, dtype=torch.int64)).tolist()
        if header[0] == OP_STOP:
            return None
        if header[0] == OP_FINISH:
            return FINISH
        payload = self.tp.broadcast_host(torch.empty(payload_size(header), dtype=torch.int64))
        return StepPacket.unpack(header, payload)
