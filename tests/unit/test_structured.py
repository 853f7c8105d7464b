"""Structured outputs below the server: the bitmask on the logits, logit_bias in the sampler,
the grammar cache, the scheduler's skip of compiling requests, and end to end through the
engine (sync and async scheduling, n > 1, preemption) with the real SmolLM2."""

import json
import threading

import jsonschema
import pytest
import torch

from rooflm.errors import InvalidRequest
from rooflm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from rooflm.sampling_params import SamplingParams, StructuredOutputsParams
from rooflm.structured.bitmask import allocate_bitmask, apply_token_bitmask, unpack_bitmask
from rooflm.structured.grammars import check_structured_outputs

# ---- the bitmask ------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [32, 77, 1000])
def test_bitmask_matches_xgrammar_reference(vocab):
    import xgrammar as xgr
    torch.manual_seed(vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, -(-vocab // 32)), dtype=torch.int32)
    logits = torch.randn(5, vocab)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab)
    out = apply_token_bitmask(logits, bitmask)
    assert torch.equal(out, expected)
    # Every allowed token keeps its logit; every other is -inf.
    allowed = unpack_bitmask(bitmask, vocab)
    assert torch.equal(out[allowed], logits[allowed])
    assert torch.isneginf(out[~allowed]).all()


def test_all_ones_rows_allow_everything_and_wider_logits_are_masked():
    logits = torch.randn(2, 70)  # the model's head is wider than the 64-token vocabulary
    bitmask = allocate_bitmask(2, 64)
    bitmask[1] = 0
    bitmask[1, 1] = 1 << 3  # only token 35 on row 1
    out = apply_token_bitmask(logits, bitmask)
    assert torch.equal(out[0, :64], logits[0, :64]) and torch.isneginf(out[0, 64:]).all()
    assert out[1].argmax().item() == 35 and torch.isneginf(out[1]).sum().item() == 69


def test_sampler_applies_the_mask_last():
    vocab = 64
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={5: 100.0}), [1], [], None),
            SamplingRow(SamplingParams(temperature=1.0, seed=1), [1], [], torch.Generator().manual_seed(1))]
    meta = SamplingMetadata.build(rows, vocab, "cpu")
    bitmask = allocate_bitmask(2, vocab)
    bitmask[0] = 0
    bitmask[0, 0] = 1 << 9  # row 0 may only say token 9, whatever its bias says
    bitmask[1] = 0
    bitmask[1, 1] = 1 << 2  # row 1: only token 34
    meta.token_bitmask = bitmask
    out = Sampler()(torch.randn(2, vocab), meta)
    assert out.sampled_token_ids.tolist() == [9, 34]


# ---- logit_bias ---------------------------------------------------------------------------------


def test_logit_bias_is_added_per_row_in_one_batch():
    vocab = 50
    logits = torch.randn(3, vocab)
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={7: 100.0}), [1], [], None),
            SamplingRow(SamplingParams(temperature=0), [1], [], None),
            SamplingRow(SamplingParams(temperature=0, logit_bias={int(logits[2].argmax()): -100,
                                                                   3: 0.5}), [1], [], None)]
    meta = SamplingMetadata.build(rows, vocab, "cpu")
    assert meta.bias_rows.tolist() == [0, 2, 2]
    sampled = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert sampled[0] == 7
    assert sampled[1] == int(logits[1].argmax())
    biased = logits[2].clone()
    biased[int(logits[2].argmax())] -= 100
    biased[3] += 0.5
    assert sampled[2] == int(biased.argmax())


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: -101}, {-1: 1.0}, {"1": 1.0}, {1: float("nan")}, [1]])
def test_logit_bias_is_validated(bias):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.param == "logit_bias"


# ---- constraints and their checks ----------------------------------------------------------------


def test_structured_params_take_exactly_one_constraint():
    with pytest.raises(InvalidRequest):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequest):
        StructuredOutputsParams(regex="a", choice=["b"])
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert spec.kind == "json" and spec.key == ("json", spec.json)
    assert spec.json.index('"b"') < spec.json.index('"a"')  # property order is kept


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(regex="(", param="guided_regex"),
    StructuredOutputsParams(json='{"type": "objekt"}', param="response_format"),
    StructuredOutputsParams(grammar="root ::= ", param="guided_grammar"),
])
def test_a_constraint_that_does_not_compile_names_its_field(spec):
    with pytest.raises(InvalidRequest) as err:
        check_structured_outputs(spec)
    assert err.value.param == spec.param
    assert "/project/" not in str(err.value)  # xgrammar's C++ location is left out


# ---- Lark grammars, as vLLM accepts them -----------------------------------------------------------

# vLLM's own documentation example of a Lark grammar.
LARK_SQL = """
?start: select_statement
?select_statement: "SELECT " column_list " FROM " table_name
?column_list: column_name ("," column_name)*
?table_name: identifier
?column_name: identifier
?identifier: /[a-zA-Z_][a-zA-Z0-9_]*/
"""
# Lark's JSON example: aliases, optional brackets, %import common and %ignore.
LARK_JSON = r"""
?start: value
?value: object | array | string | SIGNED_NUMBER -> number | "true" -> true | "null" -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""


def _accepts(spec: StructuredOutputsParams, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string
    from rooflm.structured.grammars import build_grammar
    return _is_grammar_accept_string(build_grammar(spec), text)


@pytest.mark.parametrize("grammar,good,bad", [
    (LARK_SQL, ["SELECT a,b FROM t", "SELECT x FROM users_2"], ["SELECT FROM t", "select a FROM t"]),
    (LARK_JSON, ['{"a": [1, -2.5e3, true], "b": null}', '[ ] '], ['{"a" 1}', "[1,]"]),
    # No start rule: the first rule is the start, as in vLLM.
    ('greeting: "hello" | "hi" NAME\nNAME: /[A-Z][a-z]+/', ["hello", "hiBob"], ["hi", "Hello"]),
    # EBNF (a rule defined with ::=) keeps working, Lark-looking comments and all.
    ('# digits\nroot ::= [0-9]+ ("." [0-9]+)?', ["12", "3.25"], ["1.", "a"]),
])
def test_lark_and_ebnf_grammars_are_both_accepted(grammar, good, bad):
    spec = StructuredOutputsParams(grammar=grammar, param="guided_grammar")
    check_structured_outputs(spec)
    for text in good:
        assert _accepts(spec, text), text
    for text in bad:
        assert not _accepts(spec, text), text


@pytest.mark.parametrize("grammar,words", [
    ('start: "a" (', ["read as Lark", "line 1", "')'"]),
    ("_sep{x, sep}: x (sep x)*\nstart: _sep{\"a\", \",\"}", ["read as Lark", "templates"]),
    ('root ::= "a" (', ["read as EBNF"]),
])
def test_a_bad_grammar_names_the_syntax_it_was_read_as(grammar, words):
    spec = StructuredOutputsParams(grammar=grammar, param="structured_outputs")
    with pytest.raises(InvalidRequest) as err:
        check_structured_outputs(spec)
    assert err.value.param == "structured_outputs"
    for word in words:
        assert word in str(err.value), str(err.value)


# ---- the scheduler waits for a grammar without blocking others ------------------------------------


class FakeGrammar:
    def __init__(self, ready):
        self.ready = ready


def test_a_compiling_request_lets_the_ones_behind_it_run():
    from rooflm.config import SchedulerConfig
    from rooflm.engine.block_manager import BlockManager
    from rooflm.engine.request import Request, Sequence
    from rooflm.engine.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                          BlockManager(16, 4, True))
    requests = []
    for i, ready in enumerate((False, True)):
        req = Request(f"r{i}", None, [1, 2, 3], SamplingParams(max_tokens=4), 4)
        req.grammar = FakeGrammar(ready)
        req.seqs.append(Sequence(i, 0, [1, 2, 3], 3))
        scheduler.add(req)
        requests.append(req)
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r1"]
    assert list(scheduler.waiting) == [requests[0]]  # keeps its place
    requests[0].grammar.ready = True
    out = scheduler.schedule()
    assert "r0" in [s.request.request_id for s in out.scheduled]


class CompilesWhileRead:
    """A grammar whose compile finishes between the engine's reads: not ready, then done."""

    def __init__(self):
        self.reads = 0

    @property
    def ready(self):
        return False

    @property
    def done(self):
        return True

    @property
    def error(self):
        return None


def test_a_grammar_that_compiles_while_the_engine_looks_is_not_taken_for_a_failure():
    from types import SimpleNamespace

    from rooflm.engine.llm_engine import LLMEngine
    from rooflm.engine.request import Request, RequestStatus

    req = Request("r", None, [1], SamplingParams(), 4, status=RequestStatus.WAITING)
    req.grammar = CompilesWhileRead()
    aborted = []
    engine = SimpleNamespace(_compiling=[req], abort_request=lambda rid: aborted.append(rid) or [])
    assert LLMEngine._reap_failed_grammars(engine) == []
    assert aborted == [] and engine._compiling == []


# ---- the engine, end to end, with the real model ---------------------------------------------------

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smollm():
    from rooflm.llm import LLM
    return LLM(max_model_len=256, num_blocks=64, block_size=16)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grammar_cache_compiles_each_constraint_once(smollm):
    engine = smollm.engine
    spec = StructuredOutputsParams(json=PERSON)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    smollm.generate(["A person:"], params)
    compiler = engine._grammar_compiler
    before = compiler.num_compiles
    smollm.generate(["Another person:", "A third:"],
                    SamplingParams(temperature=0, max_tokens=40,
                                   structured_outputs=StructuredOutputsParams(json=dict(PERSON))))
    assert compiler.num_compiles == before  # equal schemas share the compiled grammar
    smollm.generate(["Yes or no?"], SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    assert compiler.num_compiles == before + 1
    assert threading.current_thread().name == "MainThread"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_equals_sync_under_a_schema_with_n_and_preemption():
    from rooflm.llm import LLM
    prompts = ["Describe a person as JSON:", "JSON for a young person:", "A person record:",
               "Give me JSON about someone:"]
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    # n = 2 under preemption: one matcher per sample, forked from the prompt's.
    n2 = SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=40,
                        structured_outputs=StructuredOutputsParams(json=PERSON))
    results = []
    for mode, run_params, extra in ((False, params, {}), (True, params, {}),
                                    (True, n2, dict(num_blocks=28, block_size=4,
                                                    max_num_batched_tokens=16,
                                                    # so that the small pool preempts
                                                    reserve_new_tokens=False))):
        # quantization="none": the default model's int4 CPU path is not batch-invariant, and
        # async scheduling runs a finished sequence one step longer (other batch sizes).
        llm = LLM(max_model_len=256, num_blocks=extra.pop("num_blocks", 64),
                  async_scheduling=mode, quantization="none", **extra)
        outs = llm.generate(prompts, run_params)
        texts = [[(o.text, o.finish_reason) for o in r.outputs] for r in outs]
        results.append(texts)
        for request in texts:
            assert len(request) == run_params.n
            for text, finish in request:
                assert finish == "stop"
                jsonschema.validate(json.loads(text), PERSON)
        if extra:
            assert llm.engine.snapshot().num_preemptions > 0
        del llm
    # Async scheduling changes nothing: step t+1's mask saw step t's token. (Seeded n > 1 under
    # async scheduling, apart from masks, is tests/unit/test_async_scheduling.py's.)
    assert results[0] == results[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_grammar_that_fails_in_the_engine_aborts_only_its_request(smollm):
    engine = smollm.engine
    bad = SamplingParams(temperature=0, max_tokens=5,
                         structured_outputs=StructuredOutputsParams(regex="("))
    engine.add_request("bad", "Hello", bad)  # the engine's backstop: the API would have refused it
    engine.add_request("good", "Hello", SamplingParams(temperature=0, max_tokens=3))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].outputs[0].finish_reason == "abort"
    assert final["good"].outputs[0].finish_reason == "length"
