"""The step's block tables as one int32 array, kept across steps and updated where tables changed.

The attention kernels read block tables as a zero-padded [num_seqs, width] int32 array. Rebuilt
from every table's list each step, that array costs a pass over every entry of every table:
at batch 256 and ~1500 tokens of context, ~24,000 Python ints a step for a result that differs
from the previous step's in a few rows (a decode step grows one table in block_size). So, as
vLLM's persistent input batch does, each table keeps a row of a persistent array, rewritten
only when BlockTable.version says the table changed since (the block manager bumps it at
every change: growth, copy-on-write, trim, free, swap); the step's array gathers those rows
in batch order. Rows of tables that leave the batch (finished, preempted) go back for reuse.

The result equals block_table_array(tables) (the reference below), whose width rule it keeps:
a multiple of 16 covering the longest table.
"""

from __future__ import annotations

import itertools

import numpy as np

from rooflm.engine.block_manager import BlockTable

WIDTH_ALIGN = 16  # see block_table_array


def table_width(longest: int) -> int:
    """The array's width: a multiple of 16 over the longest table. It is the attention
    kernels' row stride, and Triton compiles a kernel variant per stride class (1, multiple of
    16, other), so a width that followed the batch's longest table made the server compile new
    variants mid-run (seconds of TTFT, measured on an H100)."""
    return -(-max(longest, 1) // WIDTH_ALIGN) * WIDTH_ALIGN


def block_table_array(tables: list[list[int]]) -> np.ndarray:
    """Reference: ragged block tables as one zero-padded [num_seqs, width] int32 array, filled in
    one numpy pass rather than a row copy per sequence."""
    lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    width = table_width(int(lens.max()) if len(tables) else 0)
    array = np.zeros((len(tables), width), dtype=np.int32)
    array[np.arange(array.shape[1])[None, :] < lens[:, None]] = flat
    return array


class BlockTableArray:
    """Persistent rows for the block tables of the last step's batch (see the module doc)."""

    def __init__(self, rows: int = 64, width: int = 64):
        # Columns in multiples of 16, so that the step's width (table_width) is always a slice.
        self._array = np.zeros((rows, table_width(width)), dtype=np.int32)
        self._row_of: dict[BlockTable, int] = {}  # by identity: a table is one sequence's
        self._version = [-1] * rows  # the table version each row holds
        self._length = [0] * rows  # entries written in each row; zeros past them
        self._free = list(range(rows - 1, -1, -1))

    def gather(self, tables: list[BlockTable]) -> np.ndarray:
        """The [len(tables), width] int32 array of these tables, in this order (a new array:
        the caller may hold it while later steps update the rows)."""
        old_row_of, row_of = self._row_of, {}
        version, length = self._version, self._length
        rows = []
        longest = 0
        for table in tables:
            row = old_row_of.pop(table, None)
            if row is None:
                row = self._take_row()
                self._write(row, table)
            elif version[row] != table.version:
                self._write(row, table)
            row_of[table] = row
            rows.append(row)
            if length[row] > longest:
                longest = length[row]
        # Tables not in this step: their rows are free for others (a table that comes back is
        # written again, as it may have changed meanwhile).
        self._free.extend(old_row_of.values())
        self._row_of = row_of
        return self._array[rows, :table_width(longest)]

    def _write(self, row: int, table: BlockTable) -> None:
        ids = table.ids
        n = len(ids)
        if n > self._array.shape[1]:
            self._grow(self._array.shape[0], table_width(max(n, 2 * self._array.shape[1])))
        array = self._array
        array[row, :n] = ids
        if self._length[row] > n:
            array[row, n:self._length[row]] = 0
        self._length[row] = n
        self._version[row] = table.version

    def _take_row(self) -> int:
        if not self._free:
            rows = self._array.shape[0]
            self._grow(2 * rows, self._array.shape[1])
            self._version.extend([-1] * rows)
            self._length.extend([0] * rows)
            self._free.extend(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def _grow(self, rows: int, width: int) -> None:
        array = np.zeros((rows, width), dtype=np.int32)
        old = self._array
        array[:old.shape[0], :old.shape[1]] = old
        self._array = array
