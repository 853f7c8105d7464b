"""The step packet rank 0 broadcasts: every field survives pack -> one int64 tensor -> unpack,
and the receiver's size formula matches what pack wrote (no process group needed)."""

import torch

from rooflm.distributed.step_broadcast import HEADER_LEN, StepPacket, payload_size


def test_a_step_packet_round_trips():
    g = torch.Generator().manual_seed(0)
    packet = StepPacket(
        input_ids=torch.randint(0, 1000, (7,), generator=g), positions=torch.arange(7) + 3,
        slot_mapping=torch.randint(0, 99, (7,), generator=g),
        query_start_loc=torch.tensor([0, 1, 2, 7], dtype=torch.int32),
        seq_lens=torch.tensor([9, 4, 12], dtype=torch.int32),
        block_tables=torch.randint(0, 50, (3, 16), generator=g, dtype=torch.int32),
        logits_indices=[0, 1, 6], max_query_len=5, num_decodes=2, pending_positions=[0, 1],
        pending_rows=[2, 0], prompt_logprob_spans=[(2, 4)], blocks_to_swap_out=[(3, 1)],
        blocks_to_swap_in=[(0, 7), (1, 8)], blocks_to_copy=[(5, 6)])
    header, payload = packet.pack()
    assert header.shape == (HEADER_LEN,) and header.dtype == payload.dtype == torch.int64
    h = header.tolist()
    assert payload.numel() == payload_size(h)  # what StepChannel.receive allocates
    back = StepPacket.unpack(h, payload)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        got, want = getattr(back, name), getattr(packet, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    for name in ("logits_indices", "max_query_len", "num_decodes", "pending_positions", "pending_rows",
                 "prompt_logprob_spans", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy"):
        assert getattr(back, name) == getattr(packet, name), name
