"""The W4A16 kernels' runtime packing of int4 codes (rooflm/kernels/w4a16.py's header has the layout).

Two codes a byte, split along K: byte j of a row holds code j (low nibble) and code S + j (high
nibble), S being half of K rounded up to whole groups. The kernels read a group's low and high
halves from the same bytes; quant/linear_method.py packs a checkpoint's codes this way once at load.
"""

import torch


def int4_split(k: int, group_size: int) -> int:
    """S, the first input of the high nibbles: half of K rounded up to whole groups, so both
    halves start on a group boundary (K / g odd pads the high half with zero codes)."""
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of the group size {group_size} to pack int4")
    return group_size * -(-(k // group_size) // 2)


def pack_int4(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 -> uint8 [N, S]: byte j holds code j (low) and S + j (high)."""
    n, k = codes.shape
    split = int4_split(k, group_size)
    codes = codes.to(torch.uint8)
    high = torch.zeros(n, split, dtype=torch.uint8, device=codes.device)
    high[:, :k - split] = codes[:, split:]
    return (codes[:, :split] | (high << 4)).contiguous()


def unpack_int4(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [N, S] -> codes uint8 [N, K]."""
    return torch.cat([qweight & 0xF, qweight >> 4], dim=1)[:, :k].contiguous()
