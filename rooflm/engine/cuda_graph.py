"""CUDA graphs for decode steps: capture once per batch size, replay every step.

A decode step of an 8B model launches hundreds of small kernels; at batch 1
their launch cost alone rivals the 5 ms the step's weight reads take. A graph
replays the whole forward (and the LM head) with one launch.

- Sizes 1, 2, 4, 8, then steps of 8 (16 past 64, 32 past 128) up to the
  batch cap; captured largest first so the smaller graphs reuse its memory in
  one shared pool.
- Static input buffers live in one dataclass; a step copies its inputs into
  them and replays the graph of the nearest captured size at or above its
  batch. Padding rows write no K/V (slot -1) and their logits are ignored.
- The split-KV decode kernel's split count is fixed per graph (sized for the
  longest context), since a graph cannot change its launch grid.
- KV cache groups (engine/kv_groups.py): each further group has its own static slot
  mapping and block tables, copied in like group 0's; its layers read them through
  meta.for_group, so the graph captures every group's addresses.
- LoRA (rooflm/lora/): each size is captured twice, with the adapters' kernels (the step has
  an adapter) and without (a step of the base model only keeps its fused one-token forms).
  Each row's adapter slot is a static input like the slot mapping, written before replay;
  rows of the base model and padding rows hold -1, which the kernels skip. The adapters' A
  and B live in the hooks' fixed slot tensors, so a replay sees whatever is loaded there now.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from rooflm.layers.attention import AttentionMetadata
from rooflm.layers.kv_cache import num_kv_groups

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    size = 8
    while size < max_batch:
        size += 8 if size < 64 else (16 if size < 128 else 32)
        sizes.append(size)
    return [s for s in sizes if s <= max_batch] or [1]


@dataclass
class GraphBuffers:
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    logits: torch.Tensor | None = None  # [B, vocab] fp32, written by the graph
    # KV cache groups 1..: each group's (slot_mapping [B] int64, block_tables [B, max_blocks] int32).
    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    # --enable-lora: each row's adapter slot [B] int32, -1 for none (rooflm/lora/mapping.py).
    lora_slots: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device, num_groups: int = 1) -> "GraphBuffers":
        return cls(
            groups=tuple((torch.full((max_batch,), -1, dtype=torch.int64, device=device),
                          torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device))
                         for _ in range(num_groups - 1)),
            input_ids=torch.zeros(max_batch, dtype=torch.int64, device=device),
            positions=torch.zeros(max_batch, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.ones(max_batch, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
        )

    def meta(self, batch: int, max_seq_len: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            max_query_len=1, max_seq_len=max_seq_len, num_decodes=batch,
            query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[max_seq_len] * batch)
        if self.groups:
            meta.groups = [meta.with_tables(slots[:batch], tables[:batch]) for slots, tables in self.groups]
        return meta


class CUDAGraphRunner:
    def __init__(self, model, kv_caches, backend, max_batch: int, max_model_len: int, block_size: int,
                 device: torch.device, lora_mapping=None):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        # Rounded up to a multiple of 16, like the eager block tables (model_runner.py), so an
        # eager table always fits the graph's buffer.
        self.max_blocks = -(-(-(-max_model_len // block_size)) // 16) * 16
        self.buffers = GraphBuffers.allocate(self.sizes[-1], self.max_blocks, device, num_kv_groups(kv_caches))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # --enable-lora: the model's LoRAMapping, put in its graph form for the adapter graphs.
        self.lora_mapping = lora_mapping
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if lora_mapping is not None:
            self.buffers.lora_slots = torch.full((self.sizes[-1],), -1, dtype=torch.int32, device=device)
        # One fp32 logits buffer [max_batch, vocab], outside the pool, that every graph widens its
        # logits into: a tensor per graph, kept alive in the pool, would hold the sum of all
        # captured batch sizes' rows (~2.4 GB for an 8B model at 512 sequences, ~8.8 at 1024).
        self.logits: Optional[torch.Tensor] = None
        self.pool = None

    def _forward(self, batch: int, lora: bool = False) -> torch.Tensor:
        # The metadata says every sequence is max_model_len long: the Triton backend then sizes
        # each window's split-KV grid for that span (TritonBackend.split_span), as eager steps do,
        # so graphs and eager sum alike per window (sliding and global layers differ).
        b = self.buffers
        meta = self._meta(batch)
        if lora:
            self.lora_mapping.use_graph_slots(b.lora_slots[:batch])
        elif self.lora_mapping is not None:
            self.lora_mapping.clear()
        hidden = self.model(b.input_ids[:batch], b.positions[:batch], self.kv_caches, meta)
        return self.model.compute_logits(hidden, out=None if self.logits is None else self.logits[:batch])

    def _meta(self, batch: int) -> AttentionMetadata:
        return self.buffers.meta(batch, self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> float:
        t0 = time.perf_counter()
        modes = (False, True) if self.lora_mapping is not None else (False,)
        for batch in reversed(self.sizes):
            for lora in modes:
                self._capture_one(batch, lora)
        if self.lora_mapping is not None:
            self.lora_mapping.clear()  # each step sets its own form again
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (batch %d..%d%s) in %.1f s", len(self.graphs) + len(self.lora_graphs),
                    self.sizes[0], self.sizes[-1], ", with and without LoRA" if self.lora_graphs else "", elapsed)
        return elapsed

    def _capture_one(self, batch: int, lora: bool) -> None:
        for _ in range(2):  # warm-up: compile the kernels outside the capture
            logits = self._forward(batch, lora)
        if self.logits is None:  # the largest batch comes first
            self.logits = torch.empty_like(logits)
        del logits
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(batch, lora)
        if self.pool is None:
            self.pool = graph.pool()
        (self.lora_graphs if lora else self.graphs)[batch] = graph

    def release(self) -> None:
        """Destroy the graphs (reset frees each executable graph and its hold on the pool)."""
        for graph in list(self.graphs.values()) + list(self.lora_graphs.values()):
            graph.reset()
        self.graphs.clear()
        self.lora_graphs.clear()
        self.logits = None
        self.pool = None

    def graph_size(self, batch: int) -> int | None:
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    def run(self, input_ids, positions, slots, seq_lens, block_tables, fixup=None, groups=(),
            lora_slots=None) -> torch.Tensor:
        """Host tensors (pinned) of a decode batch -> logits [batch, vocab]. fixup = (token
        indices, token ids) on the device: pending token ids written after the copy. groups:
        the further KV cache groups' (slots, block tables), as HostInputs.groups. lora_slots:
        each row's adapter slot [batch] int32 (-1: none) when some row has one, else None."""
        size = self.write_inputs(input_ids, positions, slots, seq_lens, block_tables, fixup, groups, lora_slots)
        (self.graphs if lora_slots is None else self.lora_graphs)[size].replay()
        return self.logits[:input_ids.shape[0]]

    def write_inputs(self, input_ids, positions, slots, seq_lens, block_tables, fixup=None, groups=(),
                     lora_slots=None) -> int:
        """A decode batch copied into the static buffers, padding rows made inert; returns the
        captured size that holds it."""
        batch = input_ids.shape[0]
        size = self.graph_size(batch)
        b = self.buffers
        b.input_ids[:batch].copy_(input_ids, non_blocking=True)
        b.positions[:batch].copy_(positions, non_blocking=True)
        b.slot_mapping[:batch].copy_(slots, non_blocking=True)
        b.seq_lens[:batch].copy_(seq_lens, non_blocking=True)
        width = block_tables.shape[1]
        b.block_tables[:batch, :width].copy_(block_tables, non_blocking=True)
        if batch < size:  # padding rows: no K/V write, a 1-token context
            b.slot_mapping[batch:size].fill_(-1)
            b.seq_lens[batch:size].fill_(1)
        for (g_slots, g_tables), (slots_g, tables_g) in zip(b.groups, groups):
            g_slots[:batch].copy_(slots_g, non_blocking=True)
            g_tables[:batch, :tables_g.shape[1]].copy_(tables_g, non_blocking=True)
            if batch < size:
                g_slots[batch:size].fill_(-1)
        if lora_slots is not None:
            if b.lora_slots is None:
                raise ValueError("a decode step with LoRA adapters, but the graphs were captured without LoRA")
            b.lora_slots[:batch].copy_(lora_slots, non_blocking=True)
            b.lora_slots[batch:size].fill_(-1)  # padding rows: no adapter work
        if fixup is not None:
            b.input_ids[fixup[0]] = fixup[1]
        return size


# --------------------------------------------------------------------------
# Uniform multi-token steps (speculative decoding's verify forward)
# --------------------------------------------------------------------------

def uniform_rows(query_start: list[int], width: int) -> np.ndarray:
    """Row of each packed token in the padded layout of a uniform graph: sequence s owns rows
    [s * width, (s + 1) * width) and its r_s tokens take the LAST r_s of them. The attention
    kernel places a sequence's first query at position seq_len - (its row count), so the real
    tokens keep their positions; the leading padding rows sit at earlier positions, write no
    K/V (slot -1) and their outputs are never read."""
    starts = np.asarray(query_start, dtype=np.int64)
    lens = np.diff(starts)
    shift = (np.arange(1, len(lens) + 1) * width - lens) - starts[:-1]  # row - packed index, per seq
    return np.repeat(shift, lens) + np.arange(starts[-1], dtype=np.int64)


def uniform_widths(max_width: int) -> list[int]:
    return list(range(2, max_width + 1))


class UniformGraphRunner:
    """CUDA graphs for steps whose sequences each compute at most `width` tokens (a verify
    forward: the last token and its drafts), for widths 2..max_width and batch sizes with
    batch x width <= max_tokens (the speculation policy's budget). Without them a verify step
    runs through the piecewise graphs: one launch per layer plus an eager attention each,
    ~2 ms of host work at batch 1 on the H100 against a ~5.5 ms forward.

    Every sequence is padded at the front to `width` rows (uniform_rows), so query_start_loc
    is the fixed arange(0, (B + 1) width, width) of the graph and the prefill kernel's launch
    grid is fixed with it. Steps where a sequence's context is shorter than the width (its
    padding rows would sit before position 0) run the other paths. Logits of every row land in
    one shared buffer: a [rows, vocab] output per graph would cost ~0.5 MB a row for 128k
    vocabularies, ~6 GB for all the graphs of an 8B model."""

    def __init__(self, model, kv_caches, max_width: int, max_tokens: int, max_batch: int,
                 max_model_len: int, block_size: int, device: torch.device, pool=None):
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.widths = uniform_widths(max_width)
        self.sizes = {w: [s for s in capture_sizes(max_batch) if s * w <= max_tokens] for w in self.widths}
        self.widths = [w for w in self.widths if self.sizes[w]]
        max_seqs = max((s[-1] for s in self.sizes.values() if s), default=1)
        self.max_rows = max((w * self.sizes[w][-1] for w in self.widths), default=1)
        max_blocks = -(-(-(-max_model_len // block_size)) // 16) * 16
        self.buffers = GraphBuffers.allocate(self.max_rows, max_blocks, device)
        self.buffers.seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.buffers.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        self.query_start = {w: torch.arange(0, (max_seqs + 1) * w, w, dtype=torch.int32, device=device)
                            for w in self.widths}
        self.logits: Optional[torch.Tensor] = None  # [max_rows, vocab], allocated at capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = pool
        # Host staging for run(), pinned once: ids, positions and slots of the padded rows, and
        # the sequence lengths. A verify step is on the latency path (batch 1: its host work is
        # device idle time), and fresh tensors pinned per step cost ~0.1 ms. `staged` marks
        # when the device has read them; the next run waits for it before writing.
        pinned = torch.device(device).type == "cuda"
        self.stage = torch.empty(3, self.max_rows, dtype=torch.int64, pin_memory=pinned)
        self.stage_lens = torch.empty(max_seqs, dtype=torch.int32, pin_memory=pinned)
        self.staged: Optional[torch.cuda.Event] = None

    def _meta(self, width: int, batch: int) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(
            slot_mapping=b.slot_mapping[:batch * width], query_start_loc=self.query_start[width][:batch + 1],
            seq_lens=b.seq_lens[:batch], block_tables=b.block_tables[:batch],
            max_query_len=width, max_seq_len=self.max_model_len, num_decodes=0,
            query_start_loc_cpu=list(range(0, (batch + 1) * width, width)),
            seq_lens_cpu=[self.max_model_len] * batch)

    def _forward(self, width: int, batch: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = batch * width
        b = self.buffers
        hidden = self.model(b.input_ids[:rows], b.positions[:rows], self.kv_caches, self._meta(width, batch))
        return self.model.compute_logits(hidden, out=out)

    @torch.inference_mode()
    def capture(self) -> float:
        t0 = time.perf_counter()
        b = self.buffers
        b.seq_lens.fill_(max(self.widths, default=1))  # every capture-time context covers its rows
        for width in reversed(self.widths):
            for batch in reversed(self.sizes[width]):
                for _ in range(2):  # warm-up: compile the kernels outside the capture
                    logits = self._forward(width, batch)
                if self.logits is None:
                    self.logits = torch.empty(self.max_rows, logits.shape[1], dtype=logits.dtype,
                                              device=logits.device)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._forward(width, batch, out=self.logits[:batch * width])
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(width, batch)] = graph
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        logger.info("captured %d verify CUDA graphs (widths %s) in %.1f s", len(self.graphs),
                    self.widths, elapsed)
        return elapsed

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits = None
        self.pool = None

    def pick(self, max_query_len: int, seq_lens: list[int]) -> Optional[tuple[int, int]]:
        """(width, graph batch) for a step, or None: the narrowest width that holds every
        sequence's tokens and has a graph for the batch, if no context is shorter than it."""
        batch = len(seq_lens)
        for width in self.widths:
            if width < max_query_len:
                continue
            size = next((s for s in self.sizes[width] if s >= batch), None)
            if size is not None:
                return (width, size) if min(seq_lens) >= width else None
        return None

    def fill_stage(self, rows: np.ndarray, n: int, size: int, width: int, input_ids, positions, slots,
                   seq_lens) -> None:
        """The padded layout of a step in the host staging buffers: packed token i at row
        rows[i]; padding rows hold id 0, position 0 and slot -1 (no K/V write); padding
        sequences a context of `width`."""
        stage, lens = self.stage.numpy(), self.stage_lens.numpy()
        stage[:2, :n] = 0
        stage[2, :n] = -1
        stage[0, rows] = input_ids.numpy()
        stage[1, rows] = positions.numpy()
        stage[2, rows] = slots.numpy()
        lens[:size] = width
        lens[:len(seq_lens)] = seq_lens.numpy()

    def run(self, choice: tuple[int, int], input_ids, positions, slots, seq_lens, block_tables,
            query_start: list[int]) -> tuple[torch.Tensor, np.ndarray]:
        """Host tensors of a packed step -> (logits of the padded rows, row of each packed token)."""
        width, size = choice
        batch = len(query_start) - 1
        rows = uniform_rows(query_start, width)
        n = size * width
        if self.staged is not None:
            self.staged.synchronize()  # the previous run's copies have left the staging buffers
        self.fill_stage(rows, n, size, width, input_ids, positions, slots, seq_lens)
        b = self.buffers
        b.input_ids[:n].copy_(self.stage[0, :n], non_blocking=True)
        b.positions[:n].copy_(self.stage[1, :n], non_blocking=True)
        b.slot_mapping[:n].copy_(self.stage[2, :n], non_blocking=True)
        b.seq_lens[:size].copy_(self.stage_lens[:size], non_blocking=True)
        b.block_tables[:batch, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.staged = torch.cuda.Event()
        self.staged.record()
        self.graphs[choice].replay()
        return self.logits[:n], rows
