"""Every job that runs for minutes says how far it got (a bar or a line on stderr), and Ctrl-C
ends any command with one line, not a traceback (issue 52). Tiny runs: the output is checked to
be there, never how long anything took."""

import pytest
import torch

from rooflm import cli
from rooflm.cli import main
from tests.models.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("feedback"), "llama")
    return path


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_ctrl_c_ends_a_command_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_env", _interrupt)
    assert main(["env"]) == cli.INTERRUPTED == 130
    err = capsys.readouterr().err
    assert err.strip() == "rooflm env: interrupted (Ctrl-C)"


def test_ctrl_c_names_the_subcommand(monkeypatch, capsys):
    from rooflm.eval import commands as eval_commands

    monkeypatch.setattr(eval_commands, "run_ppl", _interrupt)
    assert main(["eval", "ppl"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "rooflm eval ppl: interrupted (Ctrl-C)" and "Traceback" not in err


def _train_args(model, *extra):
    return ["train", "--model", model, "--load-format", "safetensors", "--device", "cpu", "--seq-len", "16",
            "--micro-batch", "1", "--warmup-steps", "1", "--warmup-measure-steps", "1", "--no-profile", *extra]


def test_train_shows_steps_and_loss_and_ctrl_c_keeps_the_partial_result(tiny_llama, monkeypatch, capsys):
    assert main(_train_args(tiny_llama, "--max-steps", "3")) == 0
    err = capsys.readouterr().err
    assert "train:" in err and "3/3" in err and "loss" in err  # tqdm: steps, loss, rate and ETA

    from rooflm.train.trainer import Trainer

    real_step = Trainer.train_step

    def step_then_interrupt(self, step, timer):
        if step == 2:
            raise KeyboardInterrupt
        return real_step(self, step, timer)

    monkeypatch.setattr(Trainer, "train_step", step_then_interrupt)
    assert main(_train_args(tiny_llama, "--max-steps", "5")) == 130
    err = capsys.readouterr().err
    assert "train: stopped after 2 of 5 steps, last loss " in err
    assert err.rstrip().endswith("rooflm train: interrupted (Ctrl-C)") and "Traceback" not in err


def test_quantize_shows_each_linear(tiny_llama, tmp_path, capsys):
    assert main(["quantize", "--model", tiny_llama, "--output", str(tmp_path / "q"), "--scheme", "int8",
                 "--method", "rtn"]) == 0
    err = capsys.readouterr().err
    # The tiny Llama's 2 layers x (qkv, o, gate_up, down): a bar that counts them.
    assert "rtn 8-bit" in err and "8/8" in err and "linear" in err


def test_sequential_gptq_and_awq_show_their_layers(tiny_llama, tmp_path, capsys):
    from rooflm.llm import LLM
    from rooflm.quant.rtn import WeightScheme
    from rooflm.quantize.awq import AwqConfig, apply_awq
    from rooflm.quantize.quantize import collect_hessians
    from rooflm.quantize.sequential import sequential_gptq

    windows = [list(range(3, 35)), list(range(40, 72))]
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", quantization="none", enable_prefix_caching=False)
    act_means: dict = {}
    hessians = collect_hessians(llm, windows, act_means)
    apply_awq(llm.engine.model, hessians, act_means, AwqConfig(WeightScheme.parse("int4-g32")))
    assert "AWQ scale search" in capsys.readouterr().err
    sequential_gptq(llm, windows, WeightScheme.parse("int4-g32"))
    err = capsys.readouterr().err
    assert "sequential GPTQ" in err and "8/8" in err


def test_eval_ppl_asks_the_engine_for_a_bar():
    from rooflm.eval.ppl import perplexity

    class Recorder:
        def generate(self, windows, params, use_tqdm=False):
            self.use_tqdm = use_tqdm
            raise RuntimeError("recorded")

    llm = Recorder()
    with pytest.raises(RuntimeError, match="recorded"):
        perplexity(llm, [[1, 2, 3]], progress=True)
    assert llm.use_tqdm is True


def test_simulate_and_its_planner_show_progress(capsys):
    assert main(["simulate", "--num-prompts", "20", "--request-rate", "20", "--input-len", "50",
                 "--output-len", "10"]) == 0
    err = capsys.readouterr().err
    assert "simulating 20 req/s" in err and "20/20" in err
    assert main(["simulate", "--plan", "--rate", "30", "--slo", "ttft_p99=500ms,tpot_p50=30ms", "--gpus", "h100",
                 "--tp-options", "1", "--num-prompts", "20", "--input-len", "50", "--output-len", "10",
                 "--top", "1"]) == 0
    err = capsys.readouterr().err
    assert "planning" in err and "probe" in err and "h100 TP1 DP" in err


def test_simulate_reports_finished_requests_as_it_goes(monkeypatch):
    from rooflm.sim import simulator
    from rooflm.sim.cost_model import SyntheticCostModel
    from rooflm.sim.workload import LengthDist, synthetic_workload
    from tests.unit.test_sim import small_replica

    monkeypatch.setattr(simulator, "_PROGRESS_EVERY", 1)  # look at the clock every event ...
    monkeypatch.setattr(simulator, "PROGRESS_INTERVAL_S", 0.0)  # ... and report every time
    reqs = synthetic_workload(30, LengthDist("fixed", 16), LengthDist("fixed", 8), "poisson", 100.0, seed=0)
    seen = []
    simulator.simulate(simulator.SimConfig(small_replica(), ingress_s=0.0),
                       SyntheticCostModel(step_s=0.004, per_seq_s=1e-4), reqs, progress=seen.append)
    assert seen == sorted(seen) and seen[-1] == 30
    assert any(0 < done < 30 for done in seen)  # reported while it ran, not only at the end


def test_the_roof_measurement_says_what_it_measures(capsys):
    from rooflm.perf.gpus import measure_cpu

    spec = measure_cpu()
    assert spec.is_cpu
    assert "rooflm: measuring this CPU" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a GPU")
@pytest.mark.gpu
def test_the_gpu_measurement_says_what_it_measures(capsys):
    from rooflm.perf.gpus import measure_gpu

    measure_gpu(repeats=2)
    err = capsys.readouterr().err
    assert "bf16 matmul" in err and "copy" in err
