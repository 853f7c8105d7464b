"""The step plan (rooflm/engine/step_strategy.py): the strategy a config attaches, a strategy
attached from outside the engine running the steps, the engine's one import of spec, the
scheduler methods spec uses, and the formulas the device loop shares with the runner and the
host-path verifier (slot_of, accept_drafts, point_mass_residual_)."""

import ast
from pathlib import Path

import pytest
import torch

from rooflm import LLM, SamplingParams
from rooflm.config import SchedulerConfig
from rooflm.engine.block_manager import BlockManager, BlockTable, slot_of
from rooflm.engine.scheduler import Scheduler
from rooflm.engine.step_strategy import PlainStep, StepStrategy
from rooflm.layers.rejection import accept_drafts, point_mass_residual_
from rooflm.spec.strategy import SpecHostStep, SpecLoopStep
from tests.unit.test_scheduler import make_request, run_step
from tests.unit.test_spec_decode import BASE, GREEDY, PROMPTS, SPEC, plain, tiny_path, tokens  # noqa: F401

ENGINE = Path(__file__).resolve().parents[2] / "rooflm" / "engine"


def test_each_config_gets_its_strategy(plain, tiny_path):  # noqa: F811
    assert type(plain.engine.strategy) is PlainStep and plain.engine.spec is None
    host = LLM(model=tiny_path, speculative_method="ngram", **BASE, **SPEC)
    assert type(host.engine.strategy) is SpecHostStep and host.engine.spec_loop is None
    loop = LLM(model=tiny_path, speculative_method="ngram", speculative_device_loop=True, **BASE, **SPEC)
    assert type(loop.engine.strategy) is SpecLoopStep and loop.engine.spec_loop is loop.engine.strategy.loop


class CountingStep(StepStrategy):
    """A strategy attached from outside: the plain step, counted."""

    def __init__(self, inner: StepStrategy):
        self.inner, self.steps = inner, 0

    def step(self, t0, outputs):
        self.steps += 1
        return self.inner.step(t0, outputs)


def test_an_attached_strategy_runs_every_step(plain):  # noqa: F811
    engine = plain.engine
    original = engine.strategy
    counting = CountingStep(original)
    engine.strategy = counting.attach(engine)
    try:
        before = engine.num_steps
        out = plain.generate(PROMPTS[:2], GREEDY)
        assert counting.steps >= engine.num_steps - before > 0
    finally:
        engine.strategy = original
    assert tokens(out) == tokens(plain.generate(PROMPTS[:2], GREEDY))


def spec_imports(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [f"rooflm.{a.name}" for a in node.names] if module == "rooflm" else [module]
        else:
            continue
        found += [(node, name) for name in names if name == "rooflm.spec" or name.startswith("rooflm.spec.")]
    return found


def test_the_engine_imports_spec_only_in_strategy_for():
    """Spec sits above the engine: the engine's one import of it is strategy_for's, lazy."""
    found = []
    for path in sorted(ENGINE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = {}
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where.update({id(node): fn.name for node in ast.walk(fn) if id(node) not in where})
        found += [(path.name, where.get(id(node), "<module>"), name) for node, name in spec_imports(tree)]
    assert found == [("llm_engine.py", "strategy_for", "rooflm.spec.factory")]


def test_the_scheduler_methods_spec_uses():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), BlockManager(32, 4))
    reqs = [make_request(f"r{i}", 5) for i in range(3)]
    for req in reqs:
        sched.add(req)
    assert sched.has_waiting_or_swapped() and sched.running_requests() == [] and sched.decoding_seqs() == []
    run_step(sched)  # two admitted (max_num_seqs), the third waits
    assert sched.running_requests() == reqs[:2] and sched.has_waiting_or_swapped()
    assert sched.decoding_seqs() == [(req, req.seqs[0]) for req in reqs[:2]]
    for req in reqs[:2]:
        req.seqs[0].num_spec_slots = 2
    sched.clear_spec_slots()
    assert [req.seqs[0].num_spec_slots for req in reqs[:2]] == [0, 0]
    sched.finish(reqs[2])
    assert not sched.has_waiting_or_swapped()


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slot_of_is_the_tables_formula_on_ints_and_tensors(block_size):
    table = BlockTable(block_size, [5, 2, 9, 0, 3])
    positions = list(range(len(table) * block_size))
    ids = torch.tensor(table.ids)
    pos = torch.tensor(positions)
    on_tensors = slot_of(ids[pos // block_size], pos, block_size)
    assert on_tensors.tolist() == [table.slot(p) for p in positions] == table.slots(0, len(positions))
    assert len(set(on_tensors.tolist())) == len(positions)
    assert [s // block_size for s in on_tensors.tolist()] == [table.ids[p // block_size] for p in positions]


def test_the_shared_acceptance_and_residual_are_the_verifiers_former_formulas():
    """accept_drafts and point_mass_residual_ give exactly what verify computed before they
    were shared with the device loop: u * 1 < p(d), and (p - onehot(d)).clamp_min(0) where
    rejected, p elsewhere."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 32, generator=gen) * 3, dim=-1)
    probs[0] = 0.0
    probs[0, 4] = 1.0  # a point mass on the draft itself
    drafts = torch.randint(0, 32, (6,), generator=gen)
    drafts[0] = 4
    p_draft = probs.gather(1, drafts[:, None]).squeeze(1)
    u = torch.rand(6, generator=gen)
    assert torch.equal(accept_drafts(u, p_draft), u * torch.ones_like(p_draft) < p_draft)
    q = torch.rand(6, generator=gen)
    assert torch.equal(accept_drafts(u, p_draft, q), u * q < p_draft)
    rejected = torch.tensor([True, True, False, True, False, True])
    former = torch.where(rejected[:, None],
                         (probs - torch.zeros_like(probs).scatter_(1, drafts[:, None], 1.0)).clamp_min(0.0), probs)
    assert torch.equal(point_mass_residual_(probs.clone(), drafts, p_draft, rejected), former)
