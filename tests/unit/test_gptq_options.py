"""GPTQ's options in rooflm/quantize/gptq.py: the scale refit (same codes, lower output error) and the
range search kept off the q/k rows."""

import pytest
import torch

from rooflm.quantize.gptq import gptq_quantize, group_output_error


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_refit_lowers_the_output_error_with_the_same_codes(act_order):
    """refit keeps GPTQ's codes and zero points and only changes scales, to ones with a lower
    output error tr(dW H dW^T) (strictly lower here: GPTQ's scales are set before the
    compensation lands, so they are not the least-squares ones)."""
    g = torch.Generator().manual_seed(0)
    k, n, group = 256, 64, 64
    channel = torch.ones(k)
    channel[torch.randperm(k, generator=g)[:8]] = 10.0
    x = torch.randn(1024, k, generator=g) * channel
    w = torch.randn(n, k, generator=g) * 0.05
    h = x.T @ x
    plain = gptq_quantize(w, h, 4, group, act_order=act_order, mse=True)
    refit = gptq_quantize(w, h, 4, group, act_order=act_order, mse=True, refit=True)
    assert torch.equal(plain.codes, refit.codes) and torch.equal(plain.zeros, refit.zeros)
    before, after = group_output_error(plain, w, h), group_output_error(refit, w, h)
    assert (after <= before).all()
    assert after.sum() < 0.99 * before.sum(), (after.sum() / before.sum())


def test_mse_skip_qk_keeps_the_q_and_k_rows_at_their_full_range(tmp_path):
    """range_search_rows marks a fused qkv_proj's v rows only; GPTQ --mse then leaves the q/k
    rows' group scales at min..max (as plain GPTQ picks them) and searches the v rows'."""
    from rooflm.llm import LLM
    from rooflm.quantize.gptq import range_search_rows
    from tests.models.tiny_models import make_tiny_model
    src, _ = make_tiny_model(tmp_path, "llama", attention="gqa")
    llm = LLM(model=src, dtype="float32", device="cpu", block_size=4, quantization="none")
    attn = llm.engine.runner.model.model.layers[0].self_attn
    rows = range_search_rows(attn.qkv_proj, skip_qk=True)
    v_offset, v_size = attn.qkv_proj.shard_offsets["v"]
    assert rows.sum() == v_size and rows[v_offset:].all() and not rows[:v_offset].any()
    assert range_search_rows(attn.qkv_proj, skip_qk=False) is None
    assert range_search_rows(attn.o_proj, skip_qk=True) is None
    g = torch.Generator().manual_seed(1)
    w = attn.qkv_proj.weight.detach().float()
    w = w + torch.randn(w.shape, generator=g) * w.abs().max() * (torch.rand(w.shape, generator=g) < 0.01)  # outliers
    x = torch.randn(512, w.shape[1], generator=g)
    h = x.T @ x
    plain = gptq_quantize(w, h, 4, 32)
    full = gptq_quantize(w, h, 4, 32, mse=True)
    skip = gptq_quantize(w, h, 4, 32, mse=True, mse_rows=rows)
    assert torch.equal(skip.scales[:, :v_offset], plain.scales[:, :v_offset])
    assert torch.equal(skip.scales[:, v_offset:], full.scales[:, v_offset:])
    assert not torch.equal(full.scales[:, :v_offset], plain.scales[:, :v_offset])  # mse did shrink some q/k groups


def test_damp_is_gptq_percdamp_and_the_cli_default_is_unchanged():
    """damp adds damp * mean(diag H) to H's diagonal: the default is 0.01 (the paper's, AutoGPTQ's);
    a larger one gives other codes, passing damp * mean(diag H) * I oneself with damp ~0 the
    same ones; damp <= 0 is refused. `rooflm quantize --damp` defaults to 0.01 and is written
    to config.json's damp_percent."""
    import argparse

    from rooflm.quantize.commands import register
    from rooflm.quantize.quantize import gptq_config
    from rooflm.quant.rtn import WeightScheme
    g = torch.Generator().manual_seed(2)
    k, n = 128, 32
    x = torch.randn(64, k, generator=g) * torch.linspace(0.05, 3.0, k)  # few tokens: H badly conditioned
    w = torch.randn(n, k, generator=g)
    h = x.T @ x
    default = gptq_quantize(w, h, 4, 32, act_order=True)
    assert torch.equal(default.codes, gptq_quantize(w, h, 4, 32, act_order=True, damp=0.01).codes)
    strong = gptq_quantize(w, h, 4, 32, act_order=True, damp=0.1)
    assert not torch.equal(default.codes, strong.codes)
    # damp is relative to the diagonal: folding 0.1's worth into H by hand with damp 1e-9 ~ damp 0.1
    # (act-order sorts by the undamped diagonal either way: a constant shift keeps the order)
    by_hand = gptq_quantize(w, h + 0.1 * torch.diag(h).mean() * torch.eye(k), 4, 32, act_order=True, damp=1e-9)
    assert (by_hand.codes != strong.codes).float().mean() < 0.01
    with pytest.raises(ValueError, match="damp"):
        gptq_quantize(w, h, 4, 32, damp=0.0)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["quantize", "--output", "o"]).damp == 0.01
    assert parser.parse_args(["quantize", "--output", "o", "--damp", "0.1"]).damp == 0.1
    assert gptq_config(WeightScheme.parse("int4-g128"))["damp_percent"] == 0.01
    assert gptq_config(WeightScheme.parse("int4-g128"), damp=0.1)["damp_percent"] == 0.1


def test_the_cli_default_damping_is_gptqs():
    from rooflm.quantize.commands import GPTQ_DAMP
    from rooflm.quantize.gptq import DEFAULT_DAMP
    assert GPTQ_DAMP == DEFAULT_DAMP


@pytest.mark.parametrize("flags, message", [
    (["--gptq-v2", "--no-sequential"], "cannot be --no-sequential"),
    (["--gptq-v2", "--method", "rtn"], "applies to --method gptq"),
    (["--gptq-v2", "--gptq-v2-alpha", "2"], "0..1"),
    (["--gptq-v2-alpha", "0.5"], "give --gptq-v2 too"),
])
def test_gptq_v2_flags_are_checked_before_anything_loads(flags, message, tmp_path):
    import argparse

    from rooflm.quantize.commands import register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["quantize", "--model", str(tmp_path / "absent"), "--output", str(tmp_path / "o")] + flags)
    with pytest.raises(ValueError, match=message):
        args.func(args)
