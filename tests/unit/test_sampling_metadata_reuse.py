"""The model runner reuses the previous step's SamplingMetadata only when every row has the same
params, generator and suppressed ids in the same place, and never metadata built from histories
(penalties) or for grammars."""

import pytest
import torch

from rooflm.engine.llm_engine import LLMEngine
from rooflm.layers.sampler import SamplingMetadata, SamplingRow
from rooflm.sampling_params import SamplingParams, StructuredOutputsParams
from tests.models.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return LLMEngine.from_kwargs(model=path, device="cpu", dtype="float32").runner


def fields(meta: SamplingMetadata) -> dict:
    out = {}
    for name, value in vars(meta).items():
        out[name] = value.tolist() if isinstance(value, torch.Tensor) else value
    return out


def test_reused_only_for_the_same_rows(runner):
    plain = SamplingParams(temperature=0.7, top_p=0.9)
    greedy = SamplingParams(temperature=0)
    gen = torch.Generator().manual_seed(1)
    rows = [SamplingRow(plain, [1, 2], [3], None), SamplingRow(greedy, [4], [], None),
            SamplingRow(plain, [5], [6, 7], gen)]
    first = runner._sampling_metadata(rows)
    assert fields(first) == fields(SamplingMetadata.build(rows, runner.model_config.vocab_size, "cpu"))
    # Next step: same params, generators and suppressed ids, new histories: the same metadata.
    again = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids + [9], r.generator) for r in rows]
    assert runner._sampling_metadata(again) is first
    changes = [
        [SamplingRow(SamplingParams(temperature=0.7, top_p=0.9), [1, 2], [3], None)] + again[1:],  # equal, not same
        again[:2] + [SamplingRow(plain, [5], [6, 7], torch.Generator().manual_seed(1))],
        again[:1] + [SamplingRow(greedy, [4], [], None, (2,))] + again[2:],
        again[:2],
        list(reversed(again)),
    ]
    for changed in changes:
        meta = runner._sampling_metadata(changed)
        assert meta is not first
        assert fields(meta) == fields(SamplingMetadata.build(changed, runner.model_config.vocab_size, "cpu"))
        first = runner._sampling_metadata(again)  # back to the plain rows: rebuilt, then kept


def test_history_and_grammar_metadata_never_reused(runner):
    for params in (SamplingParams(temperature=0.5, repetition_penalty=1.2),
                   SamplingParams(temperature=0.5, presence_penalty=0.5),
                   SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))):
        rows = [SamplingRow(params, [1], [2], None)]
        first = runner._sampling_metadata(rows)
        assert runner._sampling_metadata(rows) is not first
