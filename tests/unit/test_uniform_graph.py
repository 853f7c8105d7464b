"""The uniform (verify) CUDA graphs' host-side arithmetic: which padded row each packed token of a
ragged step lands in, and which graph serves a step. The graphs themselves run on the GPU
(tests/models/test_gpu_spec.py)."""

import numpy as np
import torch

from rooflm.engine.cuda_graph import UniformGraphRunner, uniform_rows


def test_tokens_take_the_last_rows_of_their_segment():
    rows = uniform_rows([0, 5, 6, 9], width=5)
    assert rows.tolist() == [0, 1, 2, 3, 4, 9, 12, 13, 14]


def test_a_token_keeps_its_position_under_the_kernels_rule():
    # The prefill kernel puts a sequence's first row at position seq_len - rows: with the real
    # tokens at the end of a width-row segment, each keeps the position it had packed.
    query_start, width = [0, 3, 4, 8], 4
    seq_lens = [20, 7, 11]
    rows = uniform_rows(query_start, width)
    for s in range(3):
        for i in range(query_start[s], query_start[s + 1]):
            packed_pos = seq_lens[s] - (query_start[s + 1] - query_start[s]) + (i - query_start[s])
            row = rows[i]
            padded_pos = seq_lens[s] - width + (row - s * width)
            assert padded_pos == packed_pos


def test_rows_are_distinct_and_inside_the_graph():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lens = rng.integers(1, 6, size=rng.integers(1, 40))
        starts = [0] + np.cumsum(lens).tolist()
        rows = uniform_rows(starts, 5)
        assert len(set(rows.tolist())) == len(rows) and rows.max() < 5 * len(lens)


def _runner(max_width=5, max_tokens=64, max_batch=32):
    return UniformGraphRunner(model=None, kv_caches=None, max_width=max_width, max_tokens=max_tokens,
                              max_batch=max_batch, max_model_len=256, block_size=16,
                              device=torch.device("cpu"))


def test_pick_takes_the_narrowest_width_with_a_graph_for_the_batch():
    runner = _runner()
    assert runner.sizes[5][-1] * 5 <= 64 and runner.sizes[2][-1] == 32
    assert runner.pick(5, [100]) == (5, 1)
    assert runner.pick(3, [100, 100, 100]) == (3, 4)
    assert runner.pick(1, [100] * 3) == (2, 4)  # plain decodes have their own graphs; still served
    assert runner.pick(5, [100] * 13) is None  # 16 x 5 rows exceed the 64-token budget
    assert runner.pick(2, [100] * 13) == (2, 16)
    assert runner.pick(6, [100]) is None  # wider than any graph


def test_pick_refuses_contexts_shorter_than_the_width():
    runner = _runner()
    assert runner.pick(3, [100, 2]) is None  # padding rows would sit before position 0
    assert runner.pick(2, [100, 2]) == (2, 2)


def test_the_staged_layout_pads_rows_and_sequences():
    # Two sequences of 3 and 1 tokens in width-4 rows of a 3-sequence graph; stale values from a
    # larger earlier step must not survive.
    runner = _runner()
    runner.stage.fill_(7)
    runner.stage_lens.fill_(7)
    starts = [0, 3, 4]
    rows = uniform_rows(starts, 4)
    ids, pos, slots = (torch.tensor(v, dtype=torch.int64) for v in ([11, 12, 13, 21], [5, 6, 7, 9], [50, 51, 52, 90]))
    runner.fill_stage(rows, 12, 3, 4, ids, pos, slots, torch.tensor([8, 10], dtype=torch.int32))
    assert rows.tolist() == [1, 2, 3, 7]
    assert runner.stage[0, :12].tolist() == [0, 11, 12, 13, 0, 0, 0, 21, 0, 0, 0, 0]
    assert runner.stage[1, :12].tolist() == [0, 5, 6, 7, 0, 0, 0, 9, 0, 0, 0, 0]
    assert runner.stage[2, :12].tolist() == [-1, 50, 51, 52, -1, -1, -1, 90, -1, -1, -1, -1]
    assert runner.stage_lens[:3].tolist() == [8, 10, 4]
