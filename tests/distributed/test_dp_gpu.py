"""Data parallelism on 2 GPUs: two engine cores, each on its own GPU (CUDA_VISIBLE_DEVICES set by
dp/replicas.py), behind one DPClient. Each core's process holds memory on a different GPU
(nvidia-smi), and greedy tokens equal one in-process engine's for the same prompts run one at a
time (the same batches, so the same kernels). Run by benchmarks/dp.sh (pytest -m gpu)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
import torch

from rooflm import LLM
from rooflm.config import engine_config_from_kwargs
from rooflm.dp.client import DPClient
from rooflm.dp.replicas import ReplicaSet
from rooflm.engine.request_types import GenerateRequest
from rooflm.sampling_params import SamplingParams
from tests.models.tiny_models import make_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             vocab_size=1000)
PROMPTS = [[(7 * i + j) % 997 + 1 for j in range(20 + 9 * i)] for i in range(6)]
MAX_TOKENS = 24


def _gpu_of_pids() -> dict[int, str]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.strip().splitlines():
        pid, uuid = (part.strip() for part in line.split(","))
        found[int(pid)] = uuid
    return found


async def _generate_one_at_a_time(client: DPClient) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = []
    for i, prompt in enumerate(PROMPTS):
        streams = await client.generate([GenerateRequest(f"dp-{i}", prompt, params)])
        out = None
        while not streams[0].finished:
            out = await asyncio.wait_for(streams[0].next(), 120)
        tokens.append(list(out.outputs[0].token_ids))
    return tokens


def test_two_replicas_on_two_gpus_give_one_engines_greedy_tokens(tmp_path):
    path, _ = make_tiny_model(tmp_path, "llama", initializer_range=0.3, **SMALL)
    options = dict(model=str(path), dtype="float32", max_model_len=512, max_num_seqs=16)
    llm = LLM(**options)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [list(llm.generate([p], params)[0].outputs[0].token_ids) for p in PROMPTS]

    replicas = ReplicaSet.launch(engine_config_from_kwargs(**options), 2)

    async def run():
        client = DPClient(replicas, policy="round_robin")
        client.start()
        try:
            placement = _gpu_of_pids()
            gpus = [placement.get(core.process.pid) for core in replicas.replicas]
            assert None not in gpus and gpus[0] != gpus[1], placement
            got = await _generate_one_at_a_time(client)
            assert [load.num_unfinished for load in client.loads] == [0, 0]
            return got
        finally:
            await client.shutdown()

    try:
        got = asyncio.run(run())
    finally:
        replicas.close()
    assert got == expected
