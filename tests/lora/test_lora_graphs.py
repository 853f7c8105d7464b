"""Decode steps with LoRA adapters through the CUDA graph runner (engine/cuda_graph.py): the
adapter slot of each row is a static input written before replay, rows without an adapter and
padding rows hold -1.

On the CPU the graph runner runs with its replays stood in by calls of the very forward it
captures (the static buffers, the mapping's graph form, the hooks' fixed slot tensors), so
everything but the capture itself is checked here; the GPU test at the end captures for real."""

import pytest
import torch

from rooflm.engine.cuda_graph import CUDAGraphRunner
from rooflm.kernels.lora_expand import lora_expand, lora_expand_ref
from rooflm.kernels.lora_shrink import lora_shrink, lora_shrink_ref, shrink_total
from rooflm.layers.linear import FusedLinear
from rooflm.llm import LLM
from rooflm.lora.hook import LoRALinearHook
from rooflm.lora.mapping import LoRAMapping
from rooflm.lora.request import LoRARequest
from rooflm.sampling_params import SamplingParams
from tests.kernels.helpers import DEVICE, assert_close
from tests.lora.adapters import make_peft_adapter
from tests.models.tiny_models import make_tiny_model

NEW_TOKENS = 6
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 44)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 101]]


class _Replay:
    """A captured graph stood in by the call it captured."""

    def __init__(self, fn):
        self.fn = fn
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.fn()

    def reset(self):
        pass


class CPUGraphRunner(CUDAGraphRunner):
    """CUDAGraphRunner whose capture records the forward instead of a CUDA graph."""

    def _meta(self, batch):
        # A CUDA graph sizes its attention for max_model_len; the CPU backend reads the host's
        # lengths (seq_lens_cpu), which a replay on the CPU takes from the static buffer.
        meta = super()._meta(batch)
        meta.seq_lens_cpu = self.buffers.seq_lens[:batch].tolist()
        meta.max_seq_len = max(meta.seq_lens_cpu)
        return meta

    @torch.inference_mode()
    def capture(self) -> float:
        modes = (False, True) if self.lora_mapping is not None else (False,)
        for batch in reversed(self.sizes):
            for lora in modes:
                logits = self._forward(batch, lora)
                if self.logits is None:
                    self.logits = torch.empty_like(logits)
                graph = _Replay(lambda b=batch, l=lora: self._forward(b, l))
                (self.lora_graphs if lora else self.graphs)[batch] = graph
        self.lora_mapping.clear()
        return 0.0


# --------------------------------------------------------------------------
# The mapping's graph form and the hook
# --------------------------------------------------------------------------

def _hook(num_slots=3, rank=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    linear = FusedLinear(24, {"q": 16, "k": 8, "v": 8})
    torch.nn.init.normal_(linear.weight, generator=gen)
    mapping = LoRAMapping(torch.device("cpu"))
    hook = LoRALinearHook(linear, num_slots, rank, mapping, use_triton=False)
    hook.lora_a.normal_(generator=gen)
    hook.lora_b.normal_(generator=gen)
    return linear, hook, mapping


def test_graph_form_matches_the_per_step_segments_on_the_torch_path():
    linear, hook, mapping = _hook()
    slots = [2, -1, 0, 2, -1, 1, 0, -1]
    x = torch.randn(len(slots), 24)
    base = x @ linear.weight.T
    mapping.set_step(slots, decode_only=True)
    eager = hook(x, base.clone())
    buffer = torch.full((16,), -1, dtype=torch.int32)
    buffer[:len(slots)] = torch.tensor(slots, dtype=torch.int32)
    mapping.use_graph_slots(buffer[:len(slots)])
    assert mapping.active and mapping.dense and mapping.decode_only and mapping.groups == []
    graph = hook(x, base.clone())
    assert torch.allclose(graph, eager, atol=1e-5, rtol=1e-5)
    none = torch.tensor(slots) < 0
    assert torch.equal(graph[none], base[none]), "rows without an adapter keep the base output"
    assert not torch.allclose(graph[~none], base[~none])


def test_the_graph_form_reads_slots_written_after_it_was_set():
    """A replay reads the static buffer as it is now: a new step's slots, written in place."""
    linear, hook, mapping = _hook(seed=1)
    x = torch.randn(4, 24)
    base = x @ linear.weight.T
    buffer = torch.full((4,), -1, dtype=torch.int32)
    mapping.use_graph_slots(buffer)
    assert torch.equal(hook(x, base.clone()), base), "every row at -1: nothing added"
    buffer.copy_(torch.tensor([1, -1, 2, 1], dtype=torch.int32))
    after = hook(x, base.clone())
    mapping.set_step([1, -1, 2, 1], decode_only=True)
    assert not mapping.dense, "a per-step mapping leaves the graph form"
    assert torch.allclose(after, hook(x, base.clone()), atol=1e-5, rtol=1e-5)


def test_set_step_and_clear_leave_the_graph_form():
    mapping = LoRAMapping(torch.device("cpu"))
    mapping.use_graph_slots(torch.zeros(2, dtype=torch.int32))
    mapping.clear()
    assert not mapping.active and not mapping.dense
    mapping.use_graph_slots(torch.zeros(2, dtype=torch.int32))
    mapping.set_step([-1, -1], decode_only=True)
    assert not mapping.active and not mapping.dense


# --------------------------------------------------------------------------
# The graph runner's inputs
# --------------------------------------------------------------------------

def _step_tensors(batch: int, width: int = 4):
    return (torch.arange(batch, dtype=torch.int64) + 3, torch.arange(batch, dtype=torch.int64) + 10,
            torch.arange(batch, dtype=torch.int64) + 20, torch.full((batch,), 11, dtype=torch.int32),
            torch.ones(batch, width, dtype=torch.int32))


def test_write_inputs_writes_the_slot_map_and_pads_with_minus_one():
    mapping = LoRAMapping(torch.device("cpu"))
    runner = CUDAGraphRunner(model=None, kv_caches=[], backend=None, max_batch=8, max_model_len=64,
                             block_size=4, device=torch.device("cpu"), lora_mapping=mapping)
    b = runner.buffers
    assert b.lora_slots.shape == (8,) and b.lora_slots.dtype == torch.int32
    assert torch.all(b.lora_slots == -1)
    size = runner.write_inputs(*_step_tensors(5), lora_slots=torch.tensor([1, -1, 0, 0, 1], dtype=torch.int32))
    assert size == 8
    assert b.lora_slots.tolist() == [1, -1, 0, 0, 1, -1, -1, -1]
    # A smaller batch after it: its padding rows must not keep the earlier step's adapters.
    size = runner.write_inputs(*_step_tensors(2), lora_slots=torch.tensor([0, 1], dtype=torch.int32))
    assert size == 2
    assert b.lora_slots[:2].tolist() == [0, 1]
    runner.write_inputs(*_step_tensors(3), lora_slots=torch.tensor([0, 0, 0], dtype=torch.int32))
    assert b.lora_slots.tolist()[:4] == [0, 0, 0, -1]


def test_a_step_with_adapters_needs_graphs_captured_with_lora():
    runner = CUDAGraphRunner(model=None, kv_caches=[], backend=None, max_batch=4, max_model_len=64,
                             block_size=4, device=torch.device("cpu"))
    assert runner.buffers.lora_slots is None
    with pytest.raises(ValueError, match="captured without LoRA"):
        runner.write_inputs(*_step_tensors(2), lora_slots=torch.tensor([0, -1], dtype=torch.int32))


# --------------------------------------------------------------------------
# The engine: decode steps through the graph runner against eager steps
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_graphs")
    base_path, _ = make_tiny_model(root, "llama", initializer_range=0.3)
    a1, _ = make_peft_adapter(base_path, root / "a1", rank=8, alpha=16, seed=1)
    a2, _ = make_peft_adapter(base_path, root / "a2", rank=4, alpha=8, rslora=True,
                              targets=("q_proj", "v_proj", "down_proj"), seed=2)
    return dict(base_path=base_path, r1=LoRARequest("one", 1, a1), r2=LoRARequest("two", 2, a2))


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _mixed(tiny):
    prompts, loras = [], []
    for prompt in PROMPTS:
        for lora in (tiny["r1"], None, tiny["r2"]):
            prompts.append(prompt)
            loras.append(lora)
    return prompts, loras


def test_engine_decode_through_the_graph_runner_equals_eager(tiny):
    opts = dict(model=tiny["base_path"], dtype="float32", device="cpu", block_size=4, enable_lora=True,
                max_loras=2, max_lora_rank=8)
    prompts, loras = _mixed(tiny)
    eager = [o.outputs[0].token_ids for o in LLM(**opts).generate(prompts, GREEDY, lora_request=loras)]

    llm = LLM(**opts)
    runner = llm.engine.runner
    graphs = CPUGraphRunner(runner.model, runner.kv_caches, runner.backend, 16, runner.max_model_len,
                            runner.block_size, runner.device, lora_mapping=runner.lora_mapping)
    graphs.capture()
    runner.graphs = graphs
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == eager
    lora_replays = sum(g.replays for g in graphs.lora_graphs.values())
    assert lora_replays >= NEW_TOKENS - 1, "the decode steps with adapters ran through the LoRA graphs"
    # The base model alone: the graphs captured without the adapters' kernels.
    base_before = sum(g.replays for g in graphs.graphs.values())
    llm.generate(PROMPTS, GREEDY)
    assert sum(g.replays for g in graphs.graphs.values()) > base_before


# --------------------------------------------------------------------------
# GPU: the dense kernels, and real graphs against eager
# --------------------------------------------------------------------------

@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dense_decode_kernels_skip_rows_without_an_adapter(dtype, num_splits):
    """token_order None: every slot a group, made from token_slots on the device; slot -1 rows
    (base rows, graph padding) in none."""
    gen = torch.Generator().manual_seed(3)
    rank, k, shards = 8, 40, [(0, 24), (24, 8), (32, 8)]
    slots = [1, -1, 0, 1, -1, -1, 2]
    t = len(slots)
    x = torch.randn(t, k, generator=gen).to(dtype).to(DEVICE)
    lora_a = (torch.randn(3, len(shards) * rank, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE)
    lora_b = torch.randn(3, 40, rank, generator=gen).to(dtype).to(DEVICE)
    y = torch.randn(t, 40, generator=gen).to(dtype).to(DEVICE)
    token_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    h = lora_shrink(x, lora_a, token_slots, None, None, None, 1, True, num_splits=num_splits)
    if num_splits:
        assert h.shape[0] == num_splits, "K split over programs, partial sums apart"
    h_ref = lora_shrink_ref(x, lora_a, token_slots)
    assert_close(shrink_total(h, token_slots), h_ref, dtype, "dense shrink")
    out = y.clone()
    lora_expand(h, lora_b, out, shards, rank, token_slots, None, None, None, 1, True)
    assert_close(out, lora_expand_ref(h_ref, lora_b, y, shards, rank, token_slots), dtype, "dense expand")
    none = token_slots < 0
    assert torch.equal(out[none], y[none])
    with pytest.raises(ValueError, match="decode-only"):
        lora_shrink(x, lora_a, token_slots, None, None, None, 1, False)


@pytest.mark.gpu
def test_cuda_graphs_with_adapters_equal_eager_on_the_gpu(tiny):
    opts = dict(model=tiny["base_path"], dtype="float32", block_size=16, enable_lora=True, max_loras=2,
                max_lora_rank=8, max_num_seqs=16)
    prompts, loras = _mixed(tiny)
    eager = LLM(enforce_eager=True, **opts)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, lora_request=loras)]
    del eager
    torch.cuda.empty_cache()
    llm = LLM(**opts)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.lora_graphs, "LoRA no longer turns the graphs off"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=loras)]
    assert got == want
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert base == [w for w, lora in zip(want, loras) if lora is None]


def test_one_sequence_with_an_adapter_keeps_the_gemv_chain(tiny, monkeypatch):
    """Batch 1 on the Triton kernels (the interpreter here): the one-token GEMV chain runs with
    the adapter's shrink beside each GEMV and the delta in its epilogue, and gives the tokens
    of the plain path with the hooks in Linear.forward (the reference backend, torch hooks)."""
    opts = dict(model=tiny["base_path"], device=DEVICE, dtype="float32", block_size=4, enforce_eager=True,
                enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=32, max_num_seqs=2,
                max_num_batched_tokens=16)
    prompt, params = [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    want = LLM(attention_backend="reference", **opts).generate(prompt, params, lora_request=[tiny["r1"]])
    llm = LLM(attention_backend="triton", **opts)
    assert llm.engine.runner.model.model.layers[0].gemv is not None
    calls = []
    real = LoRALinearHook.gemv_epilogue
    monkeypatch.setattr(LoRALinearHook, "gemv_epilogue", lambda self, *a: calls.append(1) or real(self, *a))
    got = llm.generate(prompt, params, lora_request=[tiny["r1"]])
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert calls, "the decode step with the adapter ran through the GEMV chain"
