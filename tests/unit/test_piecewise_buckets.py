"""Token buckets of the piecewise CUDA graphs (the capture itself is tested on the GPU)."""

from rooflm.engine.piecewise_graph import bucket_sizes


def test_buckets_cover_every_token_count_up_to_the_budget():
    sizes = bucket_sizes(2048)
    assert sizes[0] == 16 and sizes[-1] == 2048
    assert sizes == sorted(set(sizes))
    assert sizes[:3] == [16, 32, 64]
    assert 256 in sizes and 320 in sizes and 512 in sizes and 640 in sizes
    # Padding stays under one step of the grid: at most 32, 64 or 128 tokens.
    for n in range(1, 2049):
        padded = next(s for s in sizes if s >= n)
        assert padded - n < (32 if n <= 256 else 64 if n <= 512 else 128)


def test_small_budgets():
    assert bucket_sizes(16) == [16]
    assert bucket_sizes(64) == [16, 32, 64]
    assert bucket_sizes(10) == [10]
