"""Sleep mode's regions (engine/sleep_memory.py) on the CPU, through a fake driver over host
memory: tensors moved onto a region keep their values, ties and strides; sleep "unmaps" (the
fake scribbles NaN bytes over the range, as lost physical memory would read) and wake_up maps
and copies back, so greedy tokens after it equal those before; the graphs' address check keeps
graphs whose addresses held and captures them again, naming what moved, when one did; the wake
report names its phases. The GPU half (the real driver, graphs kept) is the gpu-marked test."""

import json
import logging

import pytest
import torch

from rooflm.engine import sleep_memory
from rooflm.engine.sleep_memory import (Region, WakePhases, adopt_tensors, host_backup, stale_addresses,
                                        tensor_addresses)
from rooflm.llm import LLM
from rooflm.sampling_params import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8], [9, 4, 31]]


class FakeDriver:
    """Reserve: a host buffer; map: bookkeeping; unmap: 0xFF bytes (NaN in fp32) over the range."""

    granularity = 4096
    device = torch.device("cpu")

    def __init__(self):
        self.spaces: dict[int, torch.Tensor] = {}
        self.mapped: set[int] = set()

    def reserve(self, nbytes):
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        self.spaces[buf.data_ptr()] = buf
        return buf.data_ptr()

    def map(self, address, nbytes):
        self.mapped.add(address)
        return address

    def unmap(self, address, nbytes, handle):
        self.mapped.discard(handle)
        base = max(a for a in self.spaces if a <= address)
        self.spaces[base][address - base:address - base + nbytes].fill_(255)

    def free(self, address, nbytes):
        del self.spaces[address]

    def storage(self, address, nbytes):
        return torch._C._construct_storage_from_data_pointer(address, self.device, nbytes)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # one Parameter in two modules
        self.t = torch.nn.Parameter(torch.randn(6, 3).t())  # non-contiguous
        self.register_buffer("cos", torch.arange(5, dtype=torch.float16))


def test_adopt_keeps_values_ties_and_strides_and_maps_in_chunks(monkeypatch):
    monkeypatch.setattr(sleep_memory, "CHUNK_BYTES", 4096)
    model = Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    releases = []
    region = adopt_tensors(model, FakeDriver(), release=lambda: releases.append(1))
    lo, hi = region.address, region.address + region.nbytes
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
        assert lo <= t.data_ptr() < hi, name
    assert model.head.weight is model.embed.weight
    assert model.t.stride() == (1, 3) and not model.t.is_contiguous()
    assert model.cos.dtype == torch.float16
    assert releases and region.is_mapped
    region.unmap_all()  # what a read before wake_up would see
    assert torch.isnan(model.embed.weight).all()


def test_stale_addresses_name_what_moved_appeared_or_went():
    assert stale_addresses({"a": 1, "b": 2}, {"a": 1, "b": 2}) == []
    assert stale_addresses({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 5, "d": 4}) == ["b", "c", "d"]


def test_host_backup_is_pinned_only_for_a_gpu(monkeypatch):
    assert not host_backup(16, torch.device("cpu")).is_pinned()
    asked = []
    monkeypatch.setattr(sleep_memory.torch, "empty", lambda *a, **kw: asked.append(kw["pin_memory"]))
    host_backup(16, torch.device("cuda", 0))
    assert asked == [True]


def test_wake_phases_line_and_dict():
    phases = WakePhases(0.71, 0.02, 0.0, 0.75, "kept", "copied")
    assert phases.line(1) == ("wake_up from level 1: weights 0.71 s (copied), kv 0.02 s, graphs 0.00 s (kept), "
                              "total 0.75 s")
    assert phases.as_dict()["graphs"] == "kept" and phases.as_dict()["total_s"] == 0.75


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    # Seeded dummy weights from a config alone: level 2's wake_up draws the same ones again.
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    llm = LLM(str(path), load_format="dummy", device="cpu", dtype="float32", num_blocks=32, max_model_len=128,
              enable_sleep_mode=True)
    runner = llm.engine.runner
    # What load_model and initialize do on one GPU, here on the fake driver (before any step:
    # the prefix cache has nothing in the pool being replaced).
    runner.sleep_driver = FakeDriver()
    runner.weights_region = adopt_tensors(runner.model, runner.sleep_driver)
    runner.allocate_kv_cache(runner.kv_cache.shape[2], quiet=True, sleepable=True)
    return llm


def _greedy(llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_sleep_and_wake_on_regions_give_equal_tokens_and_report_phases(llm):
    runner = llm.engine.runner
    driver = runner.sleep_driver
    before = _greedy(llm)
    kv_address = runner.kv_cache.data_ptr()
    llm.sleep(1)
    assert not driver.mapped  # both regions' physical memory given back
    assert torch.isnan(runner.kv_cache).all() and runner._weights_host is not None
    phases = llm.wake_up()
    assert phases["level"] == 1 and phases["weights"] == "copied" and phases["graphs"] == "none"
    assert set(phases) >= {"weights_s", "kv_s", "graphs_s", "total_s"}
    assert runner.kv_cache.data_ptr() == kv_address and not runner.kv_cache.any()
    assert runner._weights_host is None
    assert _greedy(llm) == before
    llm.sleep(2)
    assert runner.model is None and runner.weights_region is None
    phases = llm.wake_up()
    assert phases["level"] == 2 and phases["weights"] == "loaded"
    assert _greedy(llm) == before
    assert llm.wake_up() is None  # awake: a no-op


class FakeGraphs:
    def __init__(self):
        self.released = False

    def release(self):
        self.released = True


def test_graphs_are_kept_when_addresses_hold_and_captured_again_naming_what_moved(llm, monkeypatch, caplog):
    runner = llm.engine.runner
    captures = []
    monkeypatch.setattr(runner, "capture_graphs", lambda: captures.append(1))
    monkeypatch.setattr(runner, "graphs", FakeGraphs())
    monkeypatch.setattr(runner, "_graph_addresses", tensor_addresses(runner.model, runner.kv_caches))
    assert runner._revalidate_graphs() == "kept" and not captures
    graphs = runner.graphs
    name, param = next(iter(runner.model.named_parameters()))
    old = param.data
    param.data = old.clone()  # moved: a replay would read the old address
    try:
        with caplog.at_level(logging.WARNING, logger="rooflm.engine.model_runner"):
            assert runner._revalidate_graphs() == "none"  # captured again (none on the CPU)
    finally:
        param.data = old
    assert graphs.released and captures == [1]
    assert name in caplog.text and "capturing the CUDA graphs again" in caplog.text
