"""The slot pool (rooflm/lora/hook.py install_lora, manager.py): every hook's A and B are views
into one [slots, elements] tensor, an adapter's host image is one row of it, and making an
adapter resident is one copy; the kernels read the views' slot stride."""

import pytest
import torch

from rooflm.config import LoRAConfig
from rooflm.llm import LLM
from rooflm.kernels.lora_expand import lora_expand, lora_expand_ref
from rooflm.kernels.lora_shrink import lora_shrink, lora_shrink_ref, shrink_total
from rooflm.lora.adapter import PROJECTIONS, load_adapter
from rooflm.lora.hook import install_lora
from rooflm.lora.manager import LoRAManager
from rooflm.lora.mapping import LoRAMapping
from rooflm.lora.request import LoRARequest
from rooflm.model.loader import load_model_config
from tests.kernels.helpers import DEVICE, assert_close
from tests.lora.adapters import make_peft_adapter
from tests.models.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_pool")
    base_path, _ = make_tiny_model(root, "llama")
    a1, _ = make_peft_adapter(base_path, root / "a1", rank=4, alpha=8, seed=1,
                              targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    return dict(base_path=base_path, a1=a1, config=load_model_config(base_path, "safetensors"))


def _manager(tiny, slots=2, rank=8):
    model = LLM(model=tiny["base_path"], dtype="float32", device="cpu", block_size=4).engine.runner.model
    hooks, pool = install_lora(model, LoRAMapping(torch.device("cpu")), slots, rank, use_triton=False)
    return LoRAManager(tiny["config"], LoRAConfig(enable_lora=True, max_loras=slots, max_lora_rank=rank),
                       hooks, pool), hooks, pool


def test_hooks_are_views_of_one_pool_and_slots_do_not_overlap(tiny):
    manager, hooks, pool = _manager(tiny)
    for hook in hooks.values():
        assert hook.lora_a.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
        assert hook.lora_a.stride(0) == pool.shape[1] == hook.lora_b.stride(0)
    spans = sorted(span for hook in hooks.values() for span in (hook.a_span[:2], hook.b_span[:2]))
    assert spans[0][0] == 0 and spans[-1][1] == pool.shape[1]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "spans tile the row, no gap, no overlap"


def test_a_resident_adapter_is_its_image_in_one_row(tiny):
    manager, hooks, pool = _manager(tiny)
    pool.fill_(7.0)  # a slot that held another adapter: whatever it held must go
    request = LoRARequest("one", 1, tiny["a1"])
    slot = manager.activate([request])[request]
    assert torch.equal(pool[slot], manager.host[request])
    adapter = load_adapter("one", tiny["a1"], tiny["config"], max_rank=8)
    r = adapter.rank
    for (layer, projection), (a, b) in adapter.weights.items():
        linear, shard = PROJECTIONS[projection]
        hook = hooks[(layer, linear)]
        i = hook.shard_names.index(shard)
        offset, size = hook.shards[i]
        assert torch.equal(hook.lora_a[slot, i * 8:i * 8 + r], a.float())
        assert torch.equal(hook.lora_a[slot, i * 8 + r:(i + 1) * 8], torch.zeros(8 - r, a.shape[1]))
        torch.testing.assert_close(hook.lora_b[slot, offset:offset + size, :r], b.float() * adapter.scaling)
        assert not hook.lora_b[slot, offset:offset + size, r:].any()
    # k_proj and gate_proj are no target: their shards are zero.
    qkv = hooks[(0, "self_attn.qkv_proj")]
    offset, size = qkv.shards[qkv.shard_names.index("k")]
    assert not qkv.lora_b[slot, offset:offset + size].any()
    assert torch.equal(pool[1 - slot], torch.full_like(pool[1 - slot], 7.0)), "the other slot is untouched"


@pytest.mark.parametrize("decode_only", [False, True])
def test_kernels_read_slots_at_the_pools_stride(decode_only):
    gen = torch.Generator().manual_seed(5)
    rank, k, out_features, shards = 8, 24, 32, [(0, 16), (16, 8), (24, 8)]
    a_numel, b_numel = len(shards) * rank * k, out_features * rank
    pool = torch.randn(3, 50 + a_numel + b_numel + 30, generator=gen).to(DEVICE)  # other hooks' columns around
    lora_a = pool[:, 50:50 + a_numel].view(3, len(shards) * rank, k)
    lora_b = pool[:, 50 + a_numel:50 + a_numel + b_numel].view(3, out_features, rank)
    assert not lora_a.is_contiguous()
    slots = [2, -1, 0, 2, 1] if decode_only else [2, -1, 0, 2, 1, 1, 0, -1, 2]
    m = LoRAMapping(torch.device(DEVICE))
    m.set_step(slots, decode_only)
    x = torch.randn(len(slots), k, generator=gen).to(DEVICE)
    y = torch.randn(len(slots), out_features, generator=gen).to(DEVICE)
    h = lora_shrink(x, lora_a, m.token_slots, m.token_order, m.seg_starts, m.seg_slots, m.max_seg_len, decode_only)
    token_slots = torch.tensor(slots, device=DEVICE)
    h_ref = lora_shrink_ref(x, lora_a, token_slots)
    assert_close(shrink_total(h, token_slots), h_ref, torch.float32, "shrink on pool views")
    out = y.clone()
    lora_expand(h, lora_b, out, shards, rank, m.token_slots, m.token_order, m.seg_starts, m.seg_slots,
                m.max_seg_len, decode_only)
    assert_close(out, lora_expand_ref(h_ref, lora_b, y, shards, rank, token_slots), torch.float32,
                 "expand on pool views")


def test_the_step_packet_carries_the_adapter_slots_and_writes():
    """Tensor parallelism: rank 0's token -> slot map and its slot writes reach the workers."""
    from rooflm.distributed.step_broadcast import StepPacket, payload_size

    packet = StepPacket(
        input_ids=torch.arange(4), positions=torch.arange(4), slot_mapping=torch.arange(4),
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32), seq_lens=torch.tensor([5, 3], dtype=torch.int32),
        block_tables=torch.zeros(2, 16, dtype=torch.int32), logits_indices=[0, 3], max_query_len=3, num_decodes=1,
        blocks_to_copy=[(1, 2)], lora_token_slots=[1, -1, -1, -1],
        lora_writes=[(1, 7, "sql", "/adapters/sql"), (0, 12, "ünïcode-name", "/tmp/a b/€")])
    header, payload = packet.pack()
    assert payload.numel() == payload_size(header.tolist())
    back = StepPacket.unpack(header.tolist(), payload)
    assert back.lora_token_slots == [1, -1, -1, -1]
    assert back.lora_writes == packet.lora_writes
    assert back.blocks_to_copy == [(1, 2)] and back.logits_indices == [0, 3]
    plain_header, plain_payload = StepPacket(
        input_ids=torch.arange(1), positions=torch.arange(1), slot_mapping=torch.arange(1),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([2], dtype=torch.int32),
        block_tables=torch.zeros(1, 16, dtype=torch.int32), logits_indices=[0], max_query_len=1,
        num_decodes=1).pack()
    plain = StepPacket.unpack(plain_header.tolist(), plain_payload)
    assert plain.lora_token_slots == [] and plain.lora_writes == []


def test_the_mapped_file_gives_safetensors_own_tensors_and_refuses_a_truncated_one(tiny, tmp_path):
    """load_adapter views the file's mapping (one host copy, into the image) where safetensors'
    load_file copies each tensor out: the same tensors; a cut file is refused by name."""
    import os
    import shutil

    from safetensors.torch import load_file

    from rooflm.lora.adapter import WEIGHTS_FILE, LoRAAdapterError, map_safetensors

    file = os.path.join(tiny["a1"], WEIGHTS_FILE)
    want, got = load_file(file), map_safetensors(file)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    cut = tmp_path / "cut"
    shutil.copytree(tiny["a1"], cut)
    with open(cut / WEIGHTS_FILE, "r+b") as f:
        f.truncate(os.path.getsize(file) - 64)
    with pytest.raises(LoRAAdapterError, match="does not load"):
        load_adapter("cut", str(cut), tiny["config"], max_rank=8)


def test_an_adapter_covering_every_element_needs_no_zeros(tiny, tmp_path):
    """Full rank on every shard of every hook: the image skips the zero pass, so every element
    must be the adapter's (the hooks' spans tile the row, checked above)."""
    full, _ = make_peft_adapter(tiny["base_path"], tmp_path / "full", rank=8, alpha=8, seed=4)
    manager, hooks, pool = _manager(tiny)
    adapter = load_adapter("full", full, tiny["config"], max_rank=8)
    shards: dict = {key: set() for key in hooks}
    for layer, projection in adapter.weights:
        linear, shard = PROJECTIONS[projection]
        shards[(layer, linear)].add(shard)
    assert all(hook.covered_by(shards[key], adapter.rank) for key, hook in hooks.items())
    image = manager.slot_image(adapter)
    for (layer, projection), (a, b) in adapter.weights.items():
        linear, shard = PROJECTIONS[projection]
        hook = hooks[(layer, linear)]
        lora_a, lora_b = hook.slot_views(image)
        i = hook.shard_names.index(shard)
        offset, size = hook.shards[i]
        assert torch.equal(lora_a[i * 8:(i + 1) * 8], a.float())
        torch.testing.assert_close(lora_b[offset:offset + size], b.float() * adapter.scaling)
