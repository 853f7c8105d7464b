"""`rooflm eval`: perplexity through the engine equals HF transformers' loss; the drift figures."""

import json
import math

import pytest
import torch

from rooflm import LLM
from rooflm.cli import build_parser, main
from rooflm.eval.drift import compare, kl_lower_bound
from rooflm.eval.ppl import perplexity
from rooflm.tokenizer.text_windows import CALIB_SKIP_WINDOWS, CALIB_WINDOWS, WINDOW, check_held_out, token_windows
from tests.models.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-eval"), "llama", initializer_range=0.3)


def test_perplexity_equals_hf_cross_entropy(tiny):
    path, hf = tiny
    ids = [(13 * i + 7) % 250 + 1 for i in range(200)]
    windows = token_windows(ids, 64, None)
    assert len(windows) == 3  # the ragged tail of 8 tokens is dropped
    llm = LLM(model=path, device="cpu", dtype="float32", enable_prefix_caching=False)
    result = perplexity(llm, windows, top_k=5)
    with torch.no_grad():
        batch = torch.tensor(windows)
        loss = hf(batch, labels=batch).loss.item()  # mean over the 63 scored tokens of each window
    assert result.num_scored == 3 * 63
    assert result.nll == pytest.approx(loss, rel=1e-4)
    assert result.ppl == pytest.approx(math.exp(loss), rel=1e-4)
    assert all(len(p.top) == 5 for p in result.positions)


def test_window_errors_name_the_problem():
    with pytest.raises(ValueError, match="window must be >= 2"):
        token_windows([1, 2, 3], 1, None)
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows([1, 2, 3], 8, None)


def test_scored_windows_stay_before_the_calibration_windows(tiny, tmp_path, capsys):
    # quantize calibrates from the constant's window on; eval ppl scores from the start.
    quantize = build_parser().parse_args(["quantize", "--output", "x"])
    assert (quantize.calib_skip_windows, quantize.calib_window) == (CALIB_SKIP_WINDOWS, WINDOW)
    ppl = build_parser().parse_args(["eval", "ppl"])
    assert (ppl.max_windows, ppl.window) == (16, WINDOW)  # the default is unchanged
    check_held_out(WINDOW, 16)
    check_held_out(WINDOW, CALIB_SKIP_WINDOWS)  # every held-out window: 0 .. CALIB_SKIP_WINDOWS - 1
    check_held_out(2 * WINDOW, CALIB_SKIP_WINDOWS // 2)
    end = (CALIB_SKIP_WINDOWS + 1) * WINDOW
    with pytest.raises(ValueError, match=f"overlaps tokens {CALIB_SKIP_WINDOWS * WINDOW}..{end - 1} "):
        check_held_out(WINDOW, CALIB_SKIP_WINDOWS + 1)
    with pytest.raises(ValueError, match="overlaps"):
        check_held_out(2 * WINDOW, CALIB_SKIP_WINDOWS // 2 + 1)
    # The CLI refuses before it loads a model, on the default text only.
    rc = main(["eval", "ppl", "--device", "cpu", "--max-windows", str(CALIB_SKIP_WINDOWS + 1)])
    assert rc == 2 and f"--max-windows {CALIB_SKIP_WINDOWS + 1} of {WINDOW} tokens" in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text("another text")
    rc = main(["eval", "ppl", "--model", tiny[0], "--device", "cpu", "--text", str(other), "--max-windows", "99"])
    assert rc == 2 and "needs a tokenizer" in capsys.readouterr().err  # past the check, to the model


def test_first_window_scores_a_later_range_clear_of_the_calibration(tiny, capsys):
    ids = list(range(1, 41))
    assert token_windows(ids, 8, None, 0) == token_windows(ids, 8, None)  # the default is unchanged
    assert token_windows(ids, 8, 2, 1) == [ids[8:16], ids[16:24]]
    assert token_windows(ids, 8, None, 3) == [ids[24:32], ids[32:40]]  # to the end of the text
    with pytest.raises(ValueError, match="first window 5: the text has 5 windows of 8 tokens"):
        token_windows(ids, 8, None, 5)
    # quantize's default --calib-windows is the constant the guard uses.
    assert build_parser().parse_args(["quantize", "--output", "x"]).calib_windows == CALIB_WINDOWS
    assert build_parser().parse_args(["eval", "ppl"]).first_window == 0
    calib_end = CALIB_SKIP_WINDOWS + CALIB_WINDOWS  # the first window after the default calibration
    check_held_out(WINDOW, 1000, calib_end)  # from there to the end of any text
    check_held_out(WINDOW, 271, 64)  # the windows past a --calib-windows 32 quantize's
    check_held_out(2 * WINDOW, 5, calib_end // 2)
    check_held_out(WINDOW, CALIB_SKIP_WINDOWS - 4, 4)  # ends just before the calibration
    # A range that starts or ends inside the calibration windows, or spans them, is refused, naming the overlap.
    lo, hi = CALIB_SKIP_WINDOWS * WINDOW, calib_end * WINDOW
    for first, count, overlap in ((calib_end - 1, 10, (hi - WINDOW, hi - 1)),
                                  (CALIB_SKIP_WINDOWS - 2, 3, (lo, lo + WINDOW - 1)),
                                  (10, 100, (lo, hi - 1))):
        with pytest.raises(ValueError, match=f"--first-window {first} --max-windows {count} of {WINDOW} tokens "
                                             f"scores tokens {first * WINDOW}..{(first + count) * WINDOW - 1} .* "
                                             f"overlaps tokens {overlap[0]}..{overlap[1]} "):
            check_held_out(WINDOW, count, first)
    # The CLI refuses before it loads a model.
    rc = main(["eval", "ppl", "--device", "cpu", "--first-window", str(calib_end - 1), "--max-windows", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and f"overlaps tokens {hi - WINDOW}..{hi - 1}" in err and f"from window {calib_end} on" in err


def test_kl_lower_bound_is_exact_on_full_supports_and_below_the_true_kl():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.4, 0.4, 0.1, 0.1])
    true_kl = float((p * (p / q).log()).sum())
    full = {i: math.log(x) for i, x in enumerate(p.tolist())}, {i: math.log(x) for i, x in enumerate(q.tolist())}
    assert kl_lower_bound(*full) == pytest.approx(true_kl, abs=1e-6)
    top2 = ({t: full[0][t] for t in (0, 1)}, {t: full[1][t] for t in (0, 1)})
    assert 0 <= kl_lower_bound(*top2) <= true_kl
    assert kl_lower_bound(full[0], full[0]) == pytest.approx(0, abs=1e-9)


def test_eval_cli_runs_and_drift_compares(tiny, tmp_path, capsys):
    # The tiny model has no tokenizer, so the CLI must refuse with a clear message...
    path, _ = tiny
    rc = main(["eval", "ppl", "--model", path, "--device", "cpu", "--max-windows", "1"])
    assert rc == 2 and "needs a tokenizer" in capsys.readouterr().err
    # ...and drift works on two results of the same windows.
    a = {"window": 4, "num_windows": 1, "num_scored": 2, "ppl": 2.0,
         "positions": [{"logprob": -0.7, "top": {"1": -0.7, "2": -0.9}}, {"logprob": -0.1, "top": {"3": -0.1}}]}
    b = dict(a, ppl=2.2, positions=[{"logprob": -0.9, "top": {"2": -0.7, "1": -0.9}},
                                    {"logprob": -0.1, "top": {"3": -0.1}}])
    d = compare(a, b)
    assert d.top1_agreement == 0.5 and d.ppl_change == pytest.approx(0.1)
    assert d.mean_abs_logprob_delta == pytest.approx(0.1)
    for name, run in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    assert main(["eval", "drift", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "top-1 agreement:             50.00%" in capsys.readouterr().out
    with pytest.raises(ValueError, match="different windows"):
        compare(a, dict(b, num_scored=3))
    with pytest.raises(ValueError, match="different windows: first_window 0 vs 64"):
        compare(a, dict(b, first_window=64))  # a result from before --first-window has none: 0
