"""StepMeter on hand-built SchedulerOutputs: the same bytes and FLOPs as step_cost, MBU/MFU from them."""

import dataclasses
import itertools

import pytest
import torch

from rooflm.config import ModelConfig
from rooflm.engine.report import EngineInfo, batch_shape
from rooflm.engine.request import Request, Sequence
from rooflm.engine.scheduler import ScheduledSeq, SchedulerOutput
from rooflm.model.presets import get_preset
from rooflm.perf import live
from rooflm.perf.gpus import GPUS
from rooflm.perf.live import StepMeter, default_gpu_for
from rooflm.perf.roofline import causal_pairs, step_cost
from rooflm.sampling_params import SamplingParams

TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)

_ids = itertools.count()


def scheduled(prompt_len, computed, new, generated=0, n=1, forked=False):
    """A ScheduledSeq whose sequence has `computed` tokens cached and `new` scheduled now."""
    prompt = [(7 * i) % 900 + 1 for i in range(prompt_len)]
    params = SamplingParams(n=n, max_tokens=64, temperature=0)
    req = Request(f"r{next(_ids)}", None, prompt, params, 64)
    seq = Sequence(next(_ids), 0, prompt + [5] * generated, prompt_len, num_computed_tokens=computed)
    req.seqs.append(seq)
    req.forked = forked
    return ScheduledSeq(req, seq, new, computed, computed + new == seq.num_tokens)


def mixed_batch():
    """Decodes, a mid-prompt chunk after a cached prefix, a whole prompt, a forking prompt."""
    return SchedulerOutput(scheduled=[
        scheduled(10, 12, 1, generated=3),  # decode: 13 positions attended
        scheduled(40, 44, 1, generated=5),  # decode: 45
        scheduled(7, 7, 1, generated=1),  # decode: 8
        scheduled(100, 32, 16),  # chunk 32..48 of 100: not sampled
        scheduled(20, 0, 20),  # a whole prompt: sampled once
        scheduled(12, 4, 8, n=3),  # a prefix hit of 4, the rest; forks into 3 samples
    ])


def expected_cost(config, weight_bytes=2.0, kv_bytes=2.0, act_bytes=2.0, compute_dtype="bf16"):
    return step_cost(
        config, num_decode_seqs=3, decode_context_tokens=13 + 45 + 8,
        prefill_tokens=16 + 20 + 8,
        prefill_attention_pairs=causal_pairs(16, 32) + causal_pairs(20, 0) + causal_pairs(8, 4),
        prefill_context_tokens=48 + 20 + 12, num_sampled_prefills=1 + 3,
        weight_bytes=weight_bytes, kv_bytes=kv_bytes, act_bytes=act_bytes, compute_dtype=compute_dtype)


@pytest.mark.parametrize("config", [TINY, get_preset("llama-3-8b")], ids=["tiny", "llama-3-8b"])
def test_bytes_and_flops_equal_step_cost_of_the_same_batch(config):
    gpu = GPUS["h100"]
    meter = StepMeter(config, 2, 2, gpu)
    stats = meter.record(batch_shape(mixed_batch()), 0.004)
    ref = expected_cost(config)
    assert stats.bytes == ref.bytes
    assert stats.flops == ref.flops
    assert stats.num_tokens == 3 + 44 and stats.num_sampled == 3 + 4
    assert stats.mbu == pytest.approx(ref.bytes / 0.004 / gpu.mem_bw, rel=1e-12)
    assert stats.mfu == pytest.approx(ref.flops / 0.004 / gpu.peak_flops("bf16"), rel=1e-12)
    assert stats.achieved_gbps == pytest.approx(ref.bytes / 0.004 / 1e9, rel=1e-12)
    assert stats.achieved_tflops == pytest.approx(ref.flops / 0.004 / 1e12, rel=1e-12)
    assert stats.mbu == pytest.approx(stats.achieved_gbps / gpu.mem_bw_gbs, rel=1e-12)


def test_without_a_gpu_mbu_and_mfu_are_none_and_fp32_is_the_default_for_4_byte_weights():
    meter = StepMeter(TINY, 4, 4, None)
    stats = meter.record(batch_shape(mixed_batch()), 0.01)
    ref = expected_cost(TINY, weight_bytes=4, kv_bytes=4, act_bytes=4, compute_dtype="fp32")
    assert (stats.bytes, stats.flops) == (ref.bytes, ref.flops)
    assert stats.mbu is None and stats.mfu is None
    assert meter.summary().mbu is None


def test_int4_weights_keep_bf16_activations():
    meter = StepMeter(TINY, 0.5 + 4 / 128, 2, GPUS["a100"])
    stats = meter.record(batch_shape(mixed_batch()), 0.002)
    ref = expected_cost(TINY, weight_bytes=0.5 + 4 / 128)
    assert (stats.bytes, stats.flops) == (ref.bytes, ref.flops)


def test_sliding_window_clips_what_decodes_and_chunks_attend():
    config = ModelConfig(architecture="MistralForCausalLM", vocab_size=1000, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, sliding_window=16)
    out = SchedulerOutput(scheduled=[scheduled(30, 40, 1, generated=11),  # 41 positions -> 16
                                     scheduled(3, 3, 1, generated=1),  # 4 positions
                                     scheduled(64, 24, 12)])  # chunk after 24 cached
    meter = StepMeter(config, 2, 2, GPUS["h100"])
    stats = meter.record(batch_shape(out, config.sliding_window), 0.001)
    ref = step_cost(config, num_decode_seqs=2, decode_context_tokens=16 + 4, prefill_tokens=12,
                    prefill_attention_pairs=causal_pairs(12, 24, 16),
                    prefill_context_tokens=16 + 12, num_sampled_prefills=0)
    assert (stats.bytes, stats.flops) == (ref.bytes, ref.flops)


def test_one_token_chunk_that_does_not_finish_the_prompt_is_not_a_decode():
    # A 1-token chunk in the middle of a prompt is not sampled; one that ends it is.
    mid = SchedulerOutput(scheduled=[scheduled(50, 20, 1)])
    end = SchedulerOutput(scheduled=[scheduled(50, 49, 1)])
    meter = StepMeter(TINY, 2, 2, None)
    assert batch_shape(mid).as_kwargs() == dict(num_decode_seqs=0, decode_context_tokens=0,
                                          prefill_tokens=1, prefill_attention_pairs=21,
                                          prefill_context_tokens=21, num_sampled_prefills=0)
    assert batch_shape(end).as_kwargs()["num_decode_seqs"] == 1
    assert batch_shape(end).as_kwargs()["decode_context_tokens"] == 50


def test_batch_shape_is_read_from_what_was_scheduled():
    """The scheduler advances the counters when it schedules (async scheduling reads results a
    step later); the meter reads the start and completion captured then, so it can run later."""
    out = SchedulerOutput(scheduled=[scheduled(20, 0, 20)])
    meter = StepMeter(TINY, 2, 2, None)
    before = batch_shape(out).as_kwargs()
    for sch in out.scheduled:
        sch.seq.num_computed_tokens += sch.num_new_tokens
    assert batch_shape(out).as_kwargs() == before
    assert before["prefill_tokens"] == 20 and before["num_sampled_prefills"] == 1


def test_summary_is_a_rolling_window():
    meter = StepMeter(TINY, 2, 2, GPUS["h100"], window=4)
    decode = SchedulerOutput(scheduled=[scheduled(10, 10 + g, 1, generated=g + 1) for g in range(8)])
    for _ in range(3):
        meter.record(batch_shape(mixed_batch()), 1.0)  # slow steps that fall out of the window
    steps = [meter.record(batch_shape(decode), 0.002) for _ in range(4)]
    s = meter.summary()
    assert s.steps == 4
    assert s.busy_s == pytest.approx(0.008)
    assert s.tokens_per_s == pytest.approx(8 * 4 / 0.008)
    assert s.sampled_per_s == pytest.approx(8 * 4 / 0.008)
    assert s.mbu == pytest.approx(sum(st.bytes for st in steps) / 0.008 / GPUS["h100"].mem_bw)
    assert s.mfu == pytest.approx(sum(st.flops for st in steps) / 0.008 / GPUS["h100"].peak_flops("bf16"))
    assert "MBU" in s.format() and "tok/s" in s.format()
    assert meter.total_steps == 7
    meter.reset()
    assert meter.summary().steps == 0 and meter.summary().format() == "no steps"


def test_record_of_256_decodes_never_builds_the_op_list(monkeypatch):
    """What keeps record() cheap enough for every step (a budget of ~50 us at 256 decode
    sequences): after construction it evaluates the affine coefficients and never calls
    step_cost, whose op list is the expensive part; its numbers are still step_cost's."""
    meter = StepMeter(get_preset("llama-3-8b"), 2, 2, GPUS["h100"])
    out = SchedulerOutput(scheduled=[scheduled(100, 100 + g, 1, generated=g + 1) for g in range(256)])
    shape = batch_shape(out)
    ref = meter.cost(shape)
    real, calls = live.step_cost, []
    monkeypatch.setattr(live, "step_cost", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    steps = [meter.record(shape, 0.01) for _ in range(200)]
    assert calls == []
    assert all((st.bytes, st.flops) == (ref.bytes, ref.flops) for st in steps)
    assert (steps[0].num_tokens, steps[0].num_sampled) == (256, 256)
    assert (meter.total_steps, meter.total_tokens) == (200, 200 * 256)


def test_default_gpu_for(monkeypatch):
    assert default_gpu_for("cpu") is None
    assert default_gpu_for(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, key in [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                      ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090")]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert default_gpu_for("cuda").key == key
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some Other GPU")
    assert default_gpu_for("cuda:0") is None


def test_for_engine_reads_the_engine_info():
    info = EngineInfo(model="tiny", model_config=TINY, max_model_len=128, block_size=16, num_blocks=8,
                      num_host_blocks=0, max_num_seqs=4, max_num_batched_tokens=64, device="cpu",
                      dtype="bfloat16", weight_dtype_bytes=2, kv_dtype_bytes=2, async_scheduling=False,
                      has_tokenizer=False, startup_s=0.0)
    meter = StepMeter.for_engine(info)
    assert (meter.weight_bytes, meter.kv_bytes, meter.act_bytes) == (2.0, 2.0, 2.0)
    assert meter.gpu is None and meter.compute_dtype == "bf16"
    meter = StepMeter.for_engine(info, gpu=GPUS["h200"])
    assert meter.gpu.key == "h200"
    # W8A8 linears (--quantization fp8) are priced at the fp8 tensor-core rate, bf16 activations or not.
    fp8 = dataclasses.replace(info, weight_dtype_bytes=1.0, matmul_dtype="fp8")
    assert StepMeter.for_engine(fp8, gpu=GPUS["h200"]).compute_dtype == "fp8"
    # Tensor parallel: one rank's share plus its all-reduces, as the throughput bound prices it
    # (the TP=2 breakdown printed TP=1's floor before).
    llama = dataclasses.replace(info, model_config=get_preset("llama-3-8b"))
    shape = batch_shape(mixed_batch())
    one = StepMeter.for_engine(llama, gpu=GPUS["h200"]).cost(shape)
    two = StepMeter.for_engine(dataclasses.replace(llama, tensor_parallel_size=2), gpu=GPUS["h200"]).cost(shape)
    assert two.bytes < 0.6 * one.bytes and two.flops < 0.6 * one.flops
    assert two.bytes == step_cost(get_preset("llama-3-8b"), **shape.as_kwargs(), weight_bytes=2.0, kv_bytes=2.0,
                                  act_bytes=2.0, compute_dtype="bf16", tp=2).bytes
    assert live.StepStats.__dataclass_fields__.keys() >= {
        "elapsed_s", "bytes", "flops", "achieved_gbps", "achieved_tflops", "mbu", "mfu"}


@pytest.mark.parametrize("preset", ["smollm2-135m", "llama-3-8b", "qwen2.5-7b", "qwen3-0.6b", "mistral-7b"])
@pytest.mark.parametrize("dtypes", [(2, 2), (4, 4), (0.5 + 4 / 128, 2), (1, 1)])
def test_per_step_fast_path_equals_step_cost(preset, dtypes):
    """record() evaluates step_cost from coefficients; every batch must give step_cost's numbers."""
    import random

    rng = random.Random(hash((preset, dtypes)) & 0xFFFF)
    meter = StepMeter(get_preset(preset), *dtypes, GPUS["h100"])
    assert meter._affine.ok
    batches = [SchedulerOutput(scheduled=[]), mixed_batch(),
               SchedulerOutput(scheduled=[scheduled(100, 32, 16)])]  # nothing sampled: no head read
    for _ in range(5):
        rows = []
        for _ in range(rng.randrange(1, 40)):
            prompt = rng.randrange(1, 300)
            if rng.random() < 0.7:
                gen = rng.randrange(1, 50)
                rows.append(scheduled(prompt, prompt + gen - 1, 1, generated=gen))
            else:
                start = rng.randrange(0, prompt)
                rows.append(scheduled(prompt, start, rng.randrange(1, prompt - start + 1),
                                      n=rng.choice([1, 1, 2])))
        batches.append(SchedulerOutput(scheduled=rows))
    for out in batches:
        ref = meter.cost(batch_shape(out))
        stats = meter.record(batch_shape(out), 0.01)
        assert (stats.bytes, stats.flops) == (ref.bytes, ref.flops)
        assert (stats.num_tokens, stats.num_sampled) == (ref.num_tokens, ref.num_sampled)


def test_a_cost_model_that_is_not_affine_is_called_every_step(monkeypatch):
    real = live.step_cost

    def squared(config, **kw):  # a made-up non-linear term
        cost = real(config, **kw)
        return type(cost)(cost.ops, cost.num_tokens, cost.num_sampled, cost.compute_dtype,
                          cost.flops + kw["prefill_tokens"] ** 2, cost.bytes, cost.comm_bytes)

    monkeypatch.setattr(live, "step_cost", squared)
    meter = StepMeter(TINY, 2, 2, None)
    assert not meter._affine.ok
    stats = meter.record(batch_shape(mixed_batch()), 0.01)
    assert stats.flops == expected_cost(TINY).flops + 44 ** 2
