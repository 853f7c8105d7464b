"""The symmetric-memory all-reduce's rendezvous is joined only by ranks whose processes agree
on how many they joined before (torch numbers the rendezvous's store keys per process: a rank
ahead would wait 180 s for keys nobody writes, rooflm/distributed/allreduce.py). On the CPU the
agreement is checked with the host group's all_gather stood in for; on 2 GPUs a second TP=2
engine in one process falls back to NCCL at once and still gives the tokens."""

from __future__ import annotations

import logging

import pytest
import torch

from rooflm.distributed import allreduce
from rooflm.distributed.allreduce import SymmAllReduce


@pytest.mark.parametrize("counts,agree", [([0, 0], True), ([1, 1], True), ([1, 0], False),
                                          ([-1, -1], False), ([0, -1], False)])
def test_ranks_join_only_when_their_processes_agree(monkeypatch, counts, agree):
    def all_gather(out, mine, group=None):
        assert mine.item() == counts[0]  # this rank's own count goes out
        for tensor, count in zip(out, counts):
            tensor.fill_(count)

    monkeypatch.setattr(allreduce.dist, "get_world_size", lambda group=None: len(counts))
    monkeypatch.setattr(allreduce.dist, "all_gather", all_gather)
    monkeypatch.setattr(SymmAllReduce, "rendezvous_joined", None if counts[0] < 0 else counts[0])
    ok, why = allreduce._same_rendezvous_count(host_group=None)
    assert ok is agree
    assert (why == "") is agree and (agree or str(counts) in why)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_second_tp2_engine_in_one_process_falls_back_to_nccl_at_once(tmp_path, caplog):
    from rooflm import LLM
    from rooflm.sampling_params import SamplingParams
    from tests.models.tiny_models import make_tiny_model

    if not (allreduce.peer_access(2)[0] and allreduce.symm_op_available()):
        pytest.skip("no peer access between GPUs 0 and 1, or this torch lacks the one-shot op")
    path, _ = make_tiny_model(tmp_path, "llama", hidden_size=256, intermediate_size=512,
                              num_attention_heads=8, vocab_size=1000)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 33, 7, 81, 12], [100, 3, 4, 5]]
    joined_before = SymmAllReduce.rendezvous_joined
    tokens, paths = [], []
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            llm = LLM(model=str(path), tensor_parallel_size=2, dtype="float32", max_model_len=256,
                      tp_allreduce="auto")
            try:
                paths.append(llm.engine.executor.tp.symm is not None)
                tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
            finally:
                llm.shutdown()
    # The first engine joins only if this process had joined none before (its workers are fresh
    # too); the second never does, and says why.
    assert paths == [joined_before == 0, False]
    assert tokens[0] == tokens[1]
    assert any("symmetric-memory rendezvous" in r.getMessage() for r in caplog.records)
