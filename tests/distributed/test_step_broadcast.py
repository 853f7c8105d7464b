"""The step packet rank 0 broadcasts: every field survives pack -> one int64 tensor -> unpack,
and the receiver's size formula matches what pack wrote; over gloo, a send does not wait for
the worker to receive, and queued packets arrive whole and in order."""

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


def _late_receiver(port: int, late_s: float, steps: int, result) -> None:
    import time

    import torch.distributed as dist

    from rooflm.distributed.group import TPGroup
    from rooflm.distributed.step_broadcast import StepChannel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    channel = StepChannel(TPGroup(rank=1, size=2, device_group=dist.group.WORLD, host_group=dist.group.WORLD))
    got = []
    for _ in range(steps):
        time.sleep(late_s)  # the worker still launching the step before
        got.append(channel.receive().input_ids.tolist())
    assert channel.receive() is None  # stop
    result.put(got)
    dist.destroy_process_group()


def test_send_returns_before_the_worker_receives_and_packets_arrive_in_order():
    """A gloo broadcast waits on the root until every receiver posts its receive; StepChannel.send
    must not (rank 0's host work would add to the workers'), and its queued packets must reach
    the worker whole and in order, with stop after them."""
    import multiprocessing
    import socket
    import time

    import torch.distributed as dist

    from rooflm.distributed.group import TPGroup
    from rooflm.distributed.step_broadcast import StepChannel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    result = spawn.Queue()
    worker = spawn.Process(target=_late_receiver, args=(port, 0.5, 3, result))
    worker.start()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        channel = StepChannel(TPGroup(rank=0, size=2, device_group=dist.group.WORLD, host_group=dist.group.WORLD))

        def packet(step: int) -> StepPacket:
            return StepPacket(input_ids=torch.arange(5) + step, positions=torch.arange(5),
                              slot_mapping=torch.arange(5), query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                              seq_lens=torch.tensor([5], dtype=torch.int32),
                              block_tables=torch.zeros(1, 16, dtype=torch.int32), logits_indices=[4],
                              max_query_len=5, num_decodes=0)

        started = time.monotonic()
        channel.send(packet(0))
        first = time.monotonic() - started
        for step in (1, 2):
            channel.send(packet(step))
        channel.send_stop()
        assert first < 0.3, f"send waited {first:.2f} s for the worker"  # it posts after 0.5 s
        assert result.get(timeout=30) == [[s + i for i in range(5)] for s in range(3)]
    finally:
        worker.join(30)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert worker.exitcode == 0
