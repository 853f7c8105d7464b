"""The loop on tiny random models: resume continues the same curve, 16-bit precisions train,
bad input gets a clear error, and the bench sweep prints its table."""

import json
import os

import pytest
import torch

from rooflm.cli import main
from rooflm.train.config import TrainConfig
from rooflm.train.data import TokenWindows
from rooflm.train.trainer import train
from tests.models.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("train"), "llama")
    return path


@pytest.fixture(scope="module")
def pattern_ids(tmp_path_factory):
    """A learnable stream: a short random phrase repeated, so the next token is predictable."""
    phrase = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    path = tmp_path_factory.mktemp("data") / "pattern.ids"
    path.write_text(" ".join(str(t) for t in phrase * 60))
    return str(path)


def tiny_config(model, **changes) -> TrainConfig:
    base = dict(model=model, load_format="safetensors", device="cpu", seq_len=32, micro_batch=2,
                max_steps=6, lr=3e-3, warmup_steps=2, progress=False, profile=False,
                warmup_measure_steps=1)
    base.update(changes)
    return TrainConfig(**base)


def test_resume_continues_the_same_loss_curve(tiny_llama, tmp_path, pattern_ids):
    whole = train(tiny_config(tiny_llama, data=pattern_ids, grad_accum=2, save_dir=str(tmp_path / "ckpt"), save_every=3))
    assert os.path.isfile(tmp_path / "ckpt" / "step-3" / "model.safetensors")
    resumed = train(tiny_config(tiny_llama, data=pattern_ids, grad_accum=2, resume=str(tmp_path / "ckpt" / "step-3")))
    assert len(whole["losses"]) == len(resumed["losses"]) == 6
    assert resumed["losses"][:3] == whole["losses"][:3]  # carried in the checkpoint
    # fp32 on the CPU: the same weights, optimizer state and data give the same numbers.
    assert resumed["losses"][3:] == whole["losses"][3:], (whole["losses"], resumed["losses"])
    # the curve went somewhere: a learning run, not a constant
    assert whole["losses"][-1] < whole["losses"][0]


def test_checkpoint_is_an_hf_model_directory(tiny_llama, tmp_path):
    """What training writes loads back in transformers with the same logits as rooflm's model."""
    import transformers

    from rooflm.train.causal import CausalLM
    from rooflm.train.trainer import build_model

    train(tiny_config(tiny_llama, max_steps=2, save_dir=str(tmp_path / "out")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    _, lm, _, _ = build_model(str(tmp_path / "out"), "safetensors", torch.device("cpu"), 16, 0)
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        ours = CausalLM(lm)(tokens)
        theirs = hf(input_ids=tokens).logits
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sixteen_bit_training_lowers_the_loss(tiny_llama, precision, pattern_ids):
    result = train(tiny_config(tiny_llama, data=pattern_ids, precision=precision, max_steps=8, fused=True))
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("knob", [dict(activation_checkpointing="full"),
                                  dict(activation_checkpointing="selective"), dict(sdpa_backend="math")])
def test_recompute_and_attention_kernel_knobs_give_the_same_step(tiny_llama, knob):
    plain = train(tiny_config(tiny_llama, max_steps=3))
    changed = train(tiny_config(tiny_llama, max_steps=3, **knob))
    assert changed["losses"] == pytest.approx(plain["losses"], rel=1e-5)


def test_distillation_pulls_the_student_toward_the_teacher(tmp_path, pattern_ids):
    teacher, _ = make_tiny_model(tmp_path, "llama", seed=1, name="teacher")
    student, _ = make_tiny_model(tmp_path, "llama", seed=2, name="student")
    result = train(tiny_config(student, data=pattern_ids, teacher=teacher, teacher_load_format="safetensors",
                               max_steps=8))
    assert result["losses"][-1] < result["losses"][0]  # the KL to the teacher falls


def test_fp8_trains_through_torchao_or_says_it_is_missing(tiny_llama, pattern_ids):
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="torchao"):
            train(tiny_config(tiny_llama, precision="fp8"))
        return
    result = train(tiny_config(tiny_llama, data=pattern_ids, precision="fp8", max_steps=4))
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["losses"][-1] < result["losses"][0]


def test_bad_input_is_named(tiny_llama, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    with pytest.raises(ValueError, match="no tokenizer"):
        train(tiny_config(tiny_llama, data=str(text)))
    ids = tmp_path / "bad.ids"
    ids.write_text("1 2 3 99999 " * 40)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        train(tiny_config(tiny_llama, data=str(ids)))
    with pytest.raises(ValueError, match="activation-checkpointing"):
        tiny_config(tiny_llama, activation_checkpointing="some")


def test_windows_depend_only_on_the_step_and_sample():
    windows = TokenWindows(torch.arange(1000), seq_len=16, vocab_size=1000, seed=3)
    one_rank, _ = windows.batch(5, 0, 1, 0, 1, micro_batch=2)
    rank0, _ = windows.batch(5, 0, 1, 0, 2, micro_batch=1)
    rank1, _ = windows.batch(5, 0, 1, 1, 2, micro_batch=1)
    assert torch.equal(one_rank, torch.cat([rank0, rank1]))
    x, y = windows.batch(0, 0, 1, 0, 1, 1)
    assert torch.equal(x[0, 1:], y[0, :-1])


def test_train_cli_writes_results(tiny_llama, tmp_path, capsys):
    ids = tmp_path / "data.ids"
    ids.write_text(" ".join(str(i % 256) for i in range(3000)))
    out = tmp_path / "r.json"
    rc = main(["train", "--model", tiny_llama, "--data", str(ids), "--device", "cpu", "--seq-len", "32",
               "--max-steps", "5", "--no-progress", "--results", str(out), "--lr-schedule", "linear"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"]
    assert result["verdict"] and result["kernels_s"]["matmul"] > 0
    assert "tokens/s" in capsys.readouterr().out


def test_bench_train_prints_the_knob_table(tiny_llama, tmp_path, capsys):
    rc = main(["bench", "train", "--model", tiny_llama, "--device", "cpu", "--seq-len", "32",
               "--max-steps", "4", "--warmup-measure-steps", "1", "--knobs", "fp32,bf16,fsdp",
               "--out", str(tmp_path)])
    assert rc == 0
    table = capsys.readouterr().out
    for knob in ("fp32", "bf16", "fsdp"):
        assert f"| {knob} |" in table
    rows = json.loads((tmp_path / "bench_train.json").read_text())["rows"]
    assert all("error" not in r for r in rows), rows


def test_qat_forward_sees_the_quantized_weights_and_exports_the_master_ones(tiny_llama, tmp_path,
                                                                           pattern_ids):
    from safetensors.torch import load_file

    from rooflm.train.causal import CausalLM
    from rooflm.train.qat import apply_qat, fake_quantize
    from rooflm.train.trainer import build_model

    _, lm, _, _ = build_model(tiny_llama, "safetensors", torch.device("cpu"), 16, 0)
    model = CausalLM(lm)
    master = model.blocks[0].layer.mlp.down_proj.weight.detach().clone()
    assert apply_qat(model, "int4") == 8  # qkv, o, gate_up, down in each of 2 layers
    seen = model.blocks[0].layer.mlp.down_proj.weight
    assert torch.equal(seen, fake_quantize(master, "int4"))
    scale = master.abs().amax(dim=1, keepdim=True) / 7
    assert torch.allclose(seen / scale, torch.round(seen / scale), atol=1e-4)  # on the int4 grid
    assert (seen / scale).abs().max() <= 8 + 1e-4

    result = train(tiny_config(tiny_llama, data=pattern_ids, qat="int4", max_steps=8,
                               save_dir=str(tmp_path / "qat")))
    assert result["losses"][-1] < result["losses"][0]
    weights = load_file(str(tmp_path / "qat" / "model.safetensors"))
    assert "model.layers.0.mlp.down_proj.weight" in weights and len(weights) == 2 * 9 + 3
