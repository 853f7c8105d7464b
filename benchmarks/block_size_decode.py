"""Does the KV block size change the decode kernel's time? One sequence of 1,024 and of
16,000 keys at block sizes 64 and 128, with the engine's launch (64 splits and the tile it picks for a
32k span), CUDA-graph replays over copies that miss L2. Usage: python benchmarks/block_size_decode.py"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels as kb  # noqa: E402
from rooflm.kernels.decode_attention import decode_config  # noqa: E402

SPAN, SPLITS = 32768, 64
for seq in (1024, 16000):
    for block_size in (64, 128, 64, 128):
        config = decode_config(128, torch.bfloat16, math.ceil(SPAN / SPLITS))
        r = kb.rooflm_decode([seq], 32, 8, 128, torch.bfloat16, block_size, config=config, num_splits=SPLITS)
        print(f"1 x {seq:6d} block {block_size:4d}: {r['ms'] * 1e3:7.2f} us  {r['GBps']:6.0f} GB/s  "
              f"config {r['config']}  err {r['rel_error']:.1e}", flush=True)
