"""The native CPU decoder (rooflm/quant/native_decode.py, csrc/decode_layer.c) against the torch
path it replaces: the same hidden states and logits to fp32-rounding level, the same K/V written
into the same paged slots, the same greedy tokens; and the steps it must leave alone."""

import numpy as np
import pytest
import torch

from rooflm.config import ModelConfig
from rooflm.layers.attention import AttentionMetadata
from rooflm.layers.kv_cache import KVCache
from rooflm.model.llama import LlamaForCausalLM
from rooflm.quant import native, native_decode
from rooflm.quant.gguf_blocks import decode

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no C compiler or no AVX2/FMA: native kernels not built")

# GQA (4 query heads on 2 KV heads), every K a multiple of 32 (GGUF blocks).
TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=120, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=256)
# Each layer's linears in a different GGUF format, so both kernels and both 4-bit variants run.
LAYER_FORMATS = ["Q4_1", "Q8_0", "Q4_0"]
BLOCK_SIZE, NUM_BLOCKS = 4, 24
# A sequence's blocks scattered over the pool: the C side must follow the block table.
BLOCK_TABLE = [7, 2, 19, 0, 11, 5, 23, 3, 14, 9, 1, 17]


def rel_err(out, ref):
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm()).item()


def quantized_weights(seed=0):
    """The tiny model's weights with every decoder linear as GGUF blocks (gguf's own quantizer)."""
    shell_weights = dict(LlamaForCausalLM(TINY, max_positions=1).dummy_weights(seed))
    out = []
    for name, tensor in shell_weights.items():
        if name.endswith("_proj.weight"):
            fmt = LAYER_FORMATS[int(name.split(".")[2])]
            raw = gguf_quants.quantize((tensor.numpy() * 2.0).astype(np.float32), GGMLQuantizationType[fmt])
            out.append((name, decode(fmt, raw, tuple(tensor.shape))))
        else:
            out.append((name, tensor))
    return out


def make_model(weights, monkeypatch, native_on=True):
    monkeypatch.setenv(native_decode.ENV_SWITCH, "1" if native_on else "0")
    model = LlamaForCausalLM(TINY, max_positions=256).eval()
    model.load_weights(iter(weights))
    model.model.choose_decoder_path()  # under this test's ROOFLM_NATIVE_DECODE
    return model


def make_cache():
    # Poisoned: a slot read before it is written shows up as NaN.
    shape = (NUM_BLOCKS, BLOCK_SIZE, TINY.num_key_value_heads, TINY.head_dim)
    return [KVCache(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
            for _ in range(TINY.num_hidden_layers)]


def step_meta(start, count, tables=(BLOCK_TABLE,), starts=None, counts=None):
    """One sequence's tokens [start, start + count) (or several sequences' when tables/starts and
    counts say: count tokens each unless counts gives each its own)."""
    if starts is None:
        starts = [start]
    counts = counts or [count] * len(starts)
    count = max(counts)
    slots, lens = [], []
    for table, s, c in zip(tables, starts, counts):
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s, s + c)]
        lens.append(s + c)
    loc = [0]
    for c in counts:
        loc.append(loc[-1] + c)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(loc, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.tensor(list(tables), dtype=torch.int32),
        max_query_len=count, max_seq_len=max(lens), num_decodes=counts.index(max(counts)) if count > 1 else len(counts),
        query_start_loc_cpu=loc, seq_lens_cpu=lens)


@pytest.fixture(scope="module")
def weights():
    return quantized_weights()


def test_native_steps_match_torch_path_and_write_the_same_cache(weights, monkeypatch):
    fast, ref = make_model(weights, monkeypatch, True), make_model(weights, monkeypatch, False)
    fast_cache, ref_cache = make_cache(), make_cache()
    ids = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    # two prefill chunks (the second with a cached prefix), then decodes
    steps = [(0, 7), (7, 6)] + [(p, 1) for p in range(13, 40)]
    for start, count in steps:
        positions = torch.arange(start, start + count)
        meta_f, meta_r = step_meta(start, count), step_meta(start, count)
        out = fast.model(ids[start:start + count], positions, fast_cache, meta_f)
        expected = ref.model(ids[start:start + count], positions, ref_cache, meta_r)
        assert fast.model.native_decoder is not None and ref.model.native_decoder is None
        assert rel_err(out, expected) < 1e-4, (start, count)
        assert rel_err(fast.compute_logits(out), ref.compute_logits(expected)) < 1e-4
    slots = step_meta(0, 40).slot_mapping
    for f, r in zip(fast_cache, ref_cache):
        for a, b in ((f.k, r.k), (f.v, r.v)):
            a, b = a.view(-1, *a.shape[2:])[slots], b.view(-1, *b.shape[2:])[slots]
            assert rel_err(a, b) < 1e-4


def test_native_step_is_the_native_decoders_result(weights, monkeypatch):
    model = make_model(weights, monkeypatch, True)
    cache_a, cache_b = make_cache(), make_cache()
    ids = torch.tensor([5, 17, 99])
    via_model = model.model(ids, torch.arange(3), cache_a, step_meta(0, 3))
    direct = model.model.native_decoder.forward(ids, torch.arange(3), cache_b, step_meta(0, 3))
    assert direct is not None and torch.equal(via_model, direct)


def test_greedy_tokens_equal_over_32_steps(weights, monkeypatch):
    tokens = {}
    for native_on in (True, False):
        model, cache = make_model(weights, monkeypatch, native_on), make_cache()
        seq = [3, 41, 7, 88, 15]
        hidden = model.model(torch.tensor(seq), torch.arange(len(seq)), cache, step_meta(0, len(seq)))
        for _ in range(32):
            seq.append(int(model.compute_logits(hidden[-1:]).argmax()))
            p = len(seq) - 1
            hidden = model.model(torch.tensor(seq[-1:]), torch.tensor([p]), cache, step_meta(p, 1))
        tokens[native_on] = seq
    assert tokens[True] == tokens[False]


def test_env_switch_turns_it_off(weights, monkeypatch):
    model = make_model(weights, monkeypatch, False)
    assert native_decode.unsupported_reason(model.model) == "ROOFLM_NATIVE_DECODE=0"
    model.model(torch.tensor([1, 2]), torch.arange(2), make_cache(), step_meta(0, 2))
    assert model.model.native_decoder is None


def test_fp8_caches_take_the_torch_path(weights, monkeypatch):
    model = make_model(weights, monkeypatch, True)
    model.model(torch.tensor([1, 2, 3]), torch.arange(3), make_cache(), step_meta(0, 3))
    decoder = model.model.native_decoder
    assert decoder is not None
    fp8 = [KVCache(c.k.to(torch.float8_e4m3fn), c.v.to(torch.float8_e4m3fn), torch.ones(c.k.shape[:3]),
                   torch.ones(c.k.shape[:3])) for c in make_cache()]
    assert decoder.forward(torch.tensor([5]), torch.tensor([0]), fp8, step_meta(0, 1)) is None


def native_calls(decoder, monkeypatch) -> list[bool]:
    """Whether each step from now on ran in C (True) or was sent down the torch path."""
    calls, real = [], decoder.forward

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(decoder, "forward", counted)
    return calls


# Three sequences' block tables, disjoint and scattered over the pool.
SEQ_TABLES = [[7, 2, 19, 0, 11, 5], [23, 3, 14, 9, 1, 17], [4, 21, 8, 13, 6, 22]]
PROMPTS = [[3, 41, 7, 88, 15, 2, 9], [60, 5, 33], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def batched_greedy(model, steps: int, batched: bool):
    """Each prompt prefilled alone, then `steps` greedy decodes of the three sequences, in one step
    of three rows (batched) or one step per sequence: the tokens and each decode's hidden states."""
    cache = make_cache()
    seqs = [list(p) for p in PROMPTS]
    last = []
    for seq, table in zip(seqs, SEQ_TABLES):
        hidden = model.model(torch.tensor(seq), torch.arange(len(seq)), cache, step_meta(0, len(seq), (table,)))
        last.append(hidden[-1:])
    hiddens = []
    for _ in range(steps):
        for i, seq in enumerate(seqs):
            seq.append(int(model.compute_logits(last[i]).argmax()))
        ends = [len(seq) - 1 for seq in seqs]
        if batched:
            ids = torch.tensor([seq[-1] for seq in seqs])
            out = model.model(ids, torch.tensor(ends), cache, step_meta(0, 1, SEQ_TABLES, starts=ends))
            last = [out[i:i + 1] for i in range(len(seqs))]
        else:
            last = [model.model(torch.tensor(seq[-1:]), torch.tensor([p]), cache, step_meta(p, 1, (table,)))
                    for seq, p, table in zip(seqs, ends, SEQ_TABLES)]
        hiddens.append(torch.cat(last))
    return seqs, hiddens


def test_batched_decode_rows_match_their_own_steps_and_the_torch_path(weights, monkeypatch):
    """A decode step of three sequences with different KV lengths runs natively, in one C call: each
    row gets the bits of its own single-sequence native step, and agrees with the torch path's
    batched step (tokens equal, hidden states to 1e-4)."""
    fast, ref = make_model(weights, monkeypatch, True), make_model(weights, monkeypatch, False)
    calls = native_calls(fast.model.native_decoder, monkeypatch)
    together, together_hidden = batched_greedy(fast, 12, batched=True)
    assert calls and all(calls)  # every step native, the batched ones included
    alone, alone_hidden = batched_greedy(fast, 12, batched=False)
    torch_path, torch_hidden = batched_greedy(ref, 12, batched=True)
    assert together == alone == torch_path
    for a, b, r in zip(together_hidden, alone_hidden, torch_hidden):
        assert torch.equal(a, b)
        assert rel_err(a, r) < 1e-4


def run_steps(model, steps, ids):
    """steps: lists of (sequence, start, count) runs, one list a step; sequence i's tokens are
    ids[i] and its blocks SEQ_TABLES[i]. The hidden states of every (sequence, position)."""
    cache, out = make_cache(), {}
    for runs in steps:
        tokens = torch.cat([ids[i][start:start + count] for i, start, count in runs])
        positions = torch.cat([torch.arange(start, start + count) for _, start, count in runs])
        meta = step_meta(0, 1, [SEQ_TABLES[i] for i, _, _ in runs], starts=[r[1] for r in runs],
                         counts=[r[2] for r in runs])
        hidden = model.model(tokens, positions, cache, meta)
        row = 0
        for i, start, count in runs:
            for p in range(start, start + count):
                out[i, p] = hidden[row]
                row += 1
    return out


def test_prefill_chunks_beside_decodes_match_each_sequence_alone_and_the_torch_path(weights, monkeypatch):
    """Mixed steps: two sequences' decode rows beside a third's prefill chunks (the first fresh,
    the second after a cached prefix), and one step of two prefill chunks at once, run natively
    in one C call each: every token gets the bits of its sequence's own native steps and agrees with
    the torch path's mixed steps."""
    fast, ref = make_model(weights, monkeypatch, True), make_model(weights, monkeypatch, False)
    gen = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, TINY.vocab_size, (20,), generator=gen) for _ in SEQ_TABLES]
    mixed = [[(0, 0, 7), (1, 0, 3)],  # two prefills in one step
             [(0, 7, 1), (1, 3, 1), (2, 0, 6)],  # decodes beside a fresh chunk
             [(0, 8, 1), (1, 4, 1), (2, 6, 5)],  # decodes beside a chunk with a cached prefix
             [(0, 9, 1), (1, 5, 1), (2, 11, 1)]]
    alone = [[run] for step in mixed for run in step]  # the same runs, one sequence a step, in order
    calls = native_calls(fast.model.native_decoder, monkeypatch)
    together = run_steps(fast, mixed, ids)
    assert calls == [True] * len(mixed)
    by_itself, torch_path = run_steps(fast, alone, ids), run_steps(ref, mixed, ids)
    assert together.keys() == by_itself.keys() == torch_path.keys()
    for key in together:
        assert torch.equal(together[key], by_itself[key]), key
    assert rel_err(torch.stack(list(together.values())), torch.stack(list(torch_path.values()))) < 1e-4
    # Cut into C calls of 4 tokens, a call's runs start and end inside sequences: the same bits.
    assert native_decode.sequence_runs([0, 1, 2, 8], 0, 4) == ([0, 1, 2], [0, 1, 2, 4])
    assert native_decode.sequence_runs([0, 1, 2, 8], 4, 8) == ([2], [0, 4])
    monkeypatch.setattr(native_decode, "MAX_CHUNK", 4)
    cut = run_steps(fast, mixed, ids)
    assert all(torch.equal(cut[key], together[key]) for key in together)


def test_biased_or_float_linears_are_refused(monkeypatch):
    monkeypatch.setenv(native_decode.ENV_SWITCH, "1")
    model = LlamaForCausalLM(TINY, max_positions=64)
    model.init_dummy_weights(0)  # float weights: no blocks for the C side to read
    reason = native_decode.unsupported_reason(model.model)
    assert reason is not None and "qkv_proj" in reason


@pytest.fixture(scope="module")
def default_model_runs():
    """The embedded SmolLM2-135M, greedy: both prompts together (batched decode steps) through the
    native decoder and through torch, and each prompt alone natively."""
    from rooflm import LLM, SamplingParams
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    mp = pytest.MonkeyPatch()
    runs = {}
    try:
        mp.setenv(native_decode.ENV_SWITCH, "1")
        llm = LLM(device="cpu")  # loaded once (the tokenizer conversion alone takes seconds)
        model = llm.engine.runner.model.model
        for native_on in ("1", "0"):
            mp.setenv(native_decode.ENV_SWITCH, native_on)
            model.choose_decoder_path()
            runs[native_on] = (llm.generate(prompts, params), model.native_decoder is not None)
        mp.setenv(native_decode.ENV_SWITCH, "1")
        model.choose_decoder_path()
        runs["alone"] = [llm.generate([prompt], params)[0] for prompt in prompts]
        llm.shutdown()
    finally:
        mp.undo()
    return runs


def _logprobs(output):
    return [next(iter(d.values())).logprob for d in output.outputs[0].logprobs]


def test_default_model_greedy_tokens_and_logprobs_match(default_model_runs):
    (fast, fast_native), (ref, ref_native) = default_model_runs["1"], default_model_runs["0"]
    assert fast_native and not ref_native
    for a, b in zip(fast, ref):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b))) < 1e-3


def test_default_model_batched_decode_matches_each_sequence_alone(default_model_runs):
    """Two prompts run together (one native prefill step of both, then native batched decodes)
    give each the tokens and logprobs of its own run alone (native batch-1 steps); the sampler's
    torch ops (log-softmax) over 2 rows or 1 may pick another reduction order, hence a tolerance
    far under the torch path's 1e-3 rather than equality."""
    together, alone = default_model_runs["1"][0], default_model_runs["alone"]
    for a, b in zip(together, alone):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b))) < 1e-5


def test_long_chunks_are_cut_into_calls_and_thread_count_changes_nothing(weights, monkeypatch):
    """A step longer than MAX_CHUNK runs as consecutive C calls (the later ones reading the earlier
    ones' K/V from the cache): the same result as one call; and 1 or 2 threads give the same bits
    (each output row and head is computed whole by one thread)."""
    model = make_model(weights, monkeypatch, True)
    ids = torch.randint(0, TINY.vocab_size, (21,), generator=torch.Generator().manual_seed(5))
    decoder = model.model.native_decoder
    whole = decoder.forward(ids, torch.arange(21), make_cache(), step_meta(0, 21))
    monkeypatch.setattr(native_decode, "MAX_CHUNK", 8)
    cut = decoder.forward(ids, torch.arange(21), make_cache(), step_meta(0, 21))
    assert rel_err(cut, whole) < 1e-5
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(decoder.forward(ids, torch.arange(21), make_cache(), step_meta(0, 21)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


# ---- the parts other families add to the Llama layer, in the C decoder --------------------------

def _parts_specs():
    from rooflm.layers.rotary import Rope
    from rooflm.model.spec import GELU_TANH, QK_NORM_HEAD, RMS_ONE_PLUS, ModelSpec
    rope = Rope(10000.0, None)
    return {
        # Gemma 3: (1 + w) pre/post norms and per-head q/k norms, GELU-tanh, a scaled score,
        # sliding and global layers with their own RoPE bases
        "gemma3": ModelSpec(post_attn_norm="post_attention_layernorm", pre_mlp_norm="pre_feedforward_layernorm",
                            post_mlp_norm="post_feedforward_layernorm", norm=RMS_ONE_PLUS, qk_norm=QK_NORM_HEAD,
                            attn_scale=0.2, layer_windows=(8, 8, None), embed_scale=8.0, mlp_act=GELU_TANH,
                            layer_ropes=(rope, rope, Rope(1e6, None))),
        # Phi-4-mini: a partial rotary (8 of 16 dims) and a window on every layer
        "phi3": ModelSpec(layer_windows=(12, 12, 12), layer_ropes=(Rope(10000.0, None, 8),) * 3),
        # Granite: multipliers; SmolLM3: a layer without RoPE
        "granite-smollm3": ModelSpec(residual_scale=0.5, attn_scale=0.1, embed_scale=3.0, logit_divisor=2.0,
                                     layer_ropes=(rope, None, rope)),
    }


def _parts_class(spec):
    from rooflm.model.decoder import CausalLM

    class PartsLM(CausalLM):
        spec_of = staticmethod(lambda cfg: spec)
    return PartsLM


def _parts_weights(cls, seed=0):
    """The spec's model with every decoder linear as GGUF blocks and its norms drawn around 1 (or 0
    for (1 + w) norms), so a norm applied twice or not at all shows."""
    gen = torch.Generator().manual_seed(seed + 7)
    out = []
    for name, tensor in cls(TINY, max_positions=1).dummy_weights(seed):
        if name.endswith("_proj.weight"):
            fmt = LAYER_FORMATS[int(name.split(".")[2])]
            raw = gguf_quants.quantize((tensor.numpy() * 2.0).astype(np.float32), GGMLQuantizationType[fmt])
            out.append((name, decode(fmt, raw, tuple(tensor.shape))))
        elif "norm" in name:
            out.append((name, tensor * 0 + 0.3 * torch.randn(tensor.shape, generator=gen) + (tensor.mean() > 0.5)))
        else:
            out.append((name, tensor))
    return out


def _parts_model(cls, weights, monkeypatch, native_on: bool):
    monkeypatch.setenv(native_decode.ENV_SWITCH, "1" if native_on else "0")
    model = cls(TINY, max_positions=256).eval()
    model.load_weights(iter(weights))
    model.model.choose_decoder_path()  # under this ROOFLM_NATIVE_DECODE
    return model


@pytest.mark.parametrize("family", ["gemma3", "phi3", "granite-smollm3"])
def test_native_decoder_computes_the_parts(family, monkeypatch):
    spec = _parts_specs()[family]
    assert spec.native_reason() is None
    cls = _parts_class(spec)
    weights = _parts_weights(cls)
    fast, ref = (_parts_model(cls, weights, monkeypatch, native_on) for native_on in (True, False))
    assert fast.model.native_decoder is not None and ref.model.native_decoder is None
    fast_cache, ref_cache = make_cache(), make_cache()
    ids = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    # prefill chunks, then decodes past every window
    for start, count in [(0, 7), (7, 6)] + [(p, 1) for p in range(13, 40)]:
        positions = torch.arange(start, start + count)
        out = fast.model(ids[start:start + count], positions, fast_cache, step_meta(start, count))
        expected = ref.model(ids[start:start + count], positions, ref_cache, step_meta(start, count))
        # Post-norms rescale whatever the int8 activation rounding left (a flipped rounding in one
        # matmul input), so these agree to a few 1e-4 rather than the Llama layer's 1e-4.
        assert rel_err(out, expected) < 5e-4, (family, start, count)
        logits, ref_logits = fast.compute_logits(out), ref.compute_logits(expected)
        assert rel_err(logits, ref_logits) < 5e-4
        assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


def test_native_decoder_refuses_what_it_does_not_compute():
    from rooflm.model.spec import QK_NORM_PROJ, ModelSpec
    assert "pre-norm" in ModelSpec(pre_attn_norm=None, post_attn_norm="post_attention_layernorm").native_reason()
    assert "projection" in ModelSpec(qk_norm=QK_NORM_PROJ).native_reason()
    assert "soft-capping" in ModelSpec(attn_softcap=50.0).native_reason()


def test_native_decoder_reads_each_layers_kv_cache_group(monkeypatch):
    """KV cache groups (engine/kv_groups.py): the sliding layers (0, 1) in group 1 with a block table
    of their own, the global layer in group 0: each layer writes and reads through its group's slots
    and table, in C as in torch."""
    import dataclasses
    spec = _parts_specs()["gemma3"]
    cls = _parts_class(spec)
    weights = _parts_weights(cls, seed=1)
    fast, ref = (_parts_model(cls, weights, monkeypatch, native_on) for native_on in (True, False))
    other_table = list(reversed(BLOCK_TABLE))

    def grouped_cache():
        return [KVCache(c.k, c.v, None, None, 1 if i < 2 else 0) for i, c in enumerate(make_cache())]

    def meta(start, count):
        m = step_meta(start, count)
        g = step_meta(start, count, tables=(other_table,))
        m.groups = [dataclasses.replace(g, groups=None)]
        return m

    fast_cache, ref_cache = grouped_cache(), grouped_cache()
    ids = torch.randint(0, TINY.vocab_size, (30,), generator=torch.Generator().manual_seed(9))
    for start, count in [(0, 9)] + [(p, 1) for p in range(9, 30)]:
        positions = torch.arange(start, start + count)
        out = fast.model(ids[start:start + count], positions, fast_cache, meta(start, count))
        expected = ref.model(ids[start:start + count], positions, ref_cache, meta(start, count))
        assert rel_err(out, expected) < 5e-4, (start, count)
    # group 1's layers wrote through the other table's slots, group 0's through the first
    slots0, slots1 = step_meta(0, 30).slot_mapping, step_meta(0, 30, tables=(other_table,)).slot_mapping
    for i, (f, r) in enumerate(zip(fast_cache, ref_cache)):
        slots = slots1 if i < 2 else slots0
        a, b = f.k.view(-1, *f.k.shape[2:])[slots], r.k.view(-1, *r.k.shape[2:])[slots]
        assert not torch.isnan(a).any() and rel_err(a, b) < 5e-4
