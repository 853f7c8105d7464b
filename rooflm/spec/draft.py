"""Draft-model proposer: a small model of the same vocabulary drafts k tokens autoregressively.

Its K/V lives in a pool of its own shape with as many blocks as the target's, addressed
through the target's block tables: the draft's K/V of position p sits in the same block and
slot as the target's. The scheduler's allocation, rollback (freed blocks), copy-on-write
and preemption therefore need nothing extra for the draft; the engine's KV budget counts both
pools (ModelRunner.extra_kv_bytes_per_block).

Per sequence the proposer remembers up to which position its K/V is valid. Each step:
  1. catch up: one forward over the tokens the draft has not seen (the whole prompt the
     first time or after a preemption; else the accepted drafts and the token after them),
     whose last logits give draft 1;
  2. k - 1 one-token forwards, each on the previous draft (the decode CUDA graph on a GPU).
The drafts the target later accepts keep their K/V valid: the next catch-up starts after
them. A draft K/V slot a sequence shares with another (a prefix hit, an n > 1 fork) is only
ever rewritten with the same tokens' K/V.

Greedy requests draft the draft's argmax; random ones draw from its softmax at the request's
temperature (with the request's generator when seeded) and hand those probabilities to the
rejection sampler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch

from rooflm.config import EngineConfig, ModelConfig
from rooflm.engine.model_runner import ModelRunner
from rooflm.engine.request import Sequence
from rooflm.layers.sampler import sample_from_probs, to_device
from rooflm.sampling_params import GREEDY_TEMPERATURE_EPS
from rooflm.spec.proposer import DraftRequest, Proposal, Proposer

logger = logging.getLogger(__name__)

# Largest packed catch-up the draft's piecewise graphs cover; longer ones (first prompts) run eagerly.
DRAFT_GRAPH_TOKENS = 256


@dataclass
class _DraftState:
    seq: Sequence
    num_preemptions: int
    valid: int  # positions [0, valid) hold the draft's K/V of the sequence's tokens
    inputs: list[int]  # drafts fed at positions valid, valid + 1, ... (K/V valid if accepted)


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, config: EngineConfig, target: ModelConfig, max_model_len: int):
        from rooflm.model.loader import load_model_config, resolve_model

        spec = config.speculative
        # The target's Hub cache; its --revision names the target's commits, not the draft's.
        self.path, self.load_format = resolve_model(spec.draft_model, spec.draft_load_format,
                                                    download_dir=config.load.download_dir)
        draft_cfg = load_model_config(self.path, self.load_format)
        if draft_cfg.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_cfg.vocab_size} tokens) differs "
                             f"from the target's ({target.vocab_size}); they must share the tokenizer")
        max_batch = max(1, (spec.speculative_max_batch_tokens or 2) // 2)
        sched = replace(config.scheduler, max_num_batched_tokens=DRAFT_GRAPH_TOKENS)
        runtime = replace(config.runtime, cuda_graph_max_batch=max_batch)
        # The draft model proposes without adapters (they are the target's): the target's
        # verify forward, under the request's adapter, decides which drafts stand.
        draft_config = replace(config, scheduler=sched, runtime=runtime,
                               load=replace(config.load, model=spec.draft_model,
                                            load_format=self.load_format),
                               lora=replace(config.lora, enable_lora=False))
        self.runner = ModelRunner(draft_config, draft_cfg, max_model_len)
        self.runner.load_model(self.path, self.load_format)
        self.vocab_size = draft_cfg.vocab_size
        self.block_size = config.cache.block_size
        self.states: dict[int, _DraftState] = {}

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def allocate(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs()

    # ---- proposing ---------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> Proposal:
        self._forget_finished()
        starts = [self._valid_prefix(item) for item in batch]
        max_k = max(item.num_slots for item in batch)
        random_rows = [i for i, item in enumerate(batch) if not item.request.params.greedy]
        probs = None
        if random_rows:
            probs = torch.zeros(len(batch), max_k, self.vocab_size, device=self.runner.device)
        tokens = torch.zeros(len(batch), max_k, dtype=torch.int64, device=self.runner.device)
        logits = self._catch_up(batch, starts)
        tokens[:, 0] = self._draw(logits, batch, list(range(len(batch))), probs, 0)
        for j in range(1, max_k):
            active = [i for i, item in enumerate(batch) if item.num_slots > j]
            if not active:
                break
            logits = self._decode(batch, active, j, tokens[active, j - 1])
            tokens[active, j] = self._draw(logits, batch, active, probs, j)
        host = tokens.tolist()  # the step's one wait for the draft model
        drafts = [host[i][:item.num_slots] for i, item in enumerate(batch)]
        for item, drafts_i in zip(batch, drafts):
            self.states[item.seq.seq_id] = _DraftState(item.seq, item.request.num_preemptions,
                                                       item.start + 1, drafts_i[:-1])
        return Proposal(drafts, probs)

    def _forget_finished(self) -> None:
        for seq_id in [s for s, st in self.states.items() if st.seq.finished]:
            del self.states[seq_id]

    def _valid_prefix(self, item: DraftRequest) -> int:
        """First position the catch-up must compute: the draft's K/V is valid before it. Never
        past the last token, whose logits give draft 1."""
        st = self.states.get(item.seq.seq_id)
        if st is None or st.num_preemptions != item.request.num_preemptions:
            return 0  # new (a fork, a prefix hit) or preempted: its blocks may hold other K/V
        valid, tokens = st.valid, item.seq.token_ids
        for draft in st.inputs:
            if valid >= len(tokens) or tokens[valid] != draft:
                break
            valid += 1
        return min(valid, item.start)

    def _catch_up(self, batch: list[DraftRequest], starts: list[int]) -> torch.Tensor:
        """One forward over each sequence's unseen tokens; logits at its last token."""
        order = sorted(range(len(batch)), key=lambda i: item_len(batch[i], starts[i]) != 1)
        ids, positions, slots, lens, tables, last = [], [], [], [], [], [0] * len(batch)
        for i in order:
            item, first = batch[i], starts[i]
            n = item.start + 1 - first
            ids.extend(item.seq.token_ids[first:item.start + 1])
            positions.extend(range(first, item.start + 1))
            slots.extend(item.seq.block_table.slots(first, n))
            lens.append(n)
            tables.append(item.seq.block_table.ids)
            last[i] = len(ids) - 1
        return self.runner.forward_logits(ids, positions, slots, lens, tables, last)

    def _decode(self, batch: list[DraftRequest], active: list[int], j: int,
                inputs: torch.Tensor) -> torch.Tensor:
        """One token per active sequence: draft j at position start + j (ids on the device)."""
        positions = [batch[i].start + j for i in active]
        slots = [batch[i].seq.block_table.slot(p) for i, p in zip(active, positions)]
        tables = [batch[i].seq.block_table.ids for i in active]
        rows = list(range(len(active)))
        fixup = (torch.arange(len(active), device=inputs.device), inputs)
        return self.runner.forward_logits([0] * len(active), positions, slots, [1] * len(active),
                                          tables, rows, fixup)

    def _draw(self, logits: torch.Tensor, batch: list[DraftRequest], rows: list[int],
              probs: Optional[torch.Tensor], j: int) -> torch.Tensor:
        """Greedy rows: the argmax. Random rows: a draw from softmax(logits / T), recorded."""
        tokens = logits.argmax(dim=-1)
        if probs is None:
            return tokens
        random_rows = [r for r, i in enumerate(rows) if not batch[i].request.params.greedy]
        if not random_rows:
            return tokens
        temps = to_device(torch.tensor([max(batch[rows[r]].request.params.temperature, GREEDY_TEMPERATURE_EPS)
                                         for r in random_rows]), logits.device)
        q = torch.softmax(logits[random_rows].float() / temps[:, None], dim=-1)
        generators = [(n, batch[rows[r]].request.generator(batch[rows[r]].seq.index))
                      for n, r in enumerate(random_rows)
                      if batch[rows[r]].request.generator(batch[rows[r]].seq.index) is not None]
        drawn = sample_from_probs(q, generators)
        index = to_device(torch.tensor(random_rows), logits.device)
        tokens = tokens.index_copy(0, index, drawn)
        probs[to_device(torch.tensor([rows[r] for r in random_rows]), logits.device), j] = q
        return tokens


def item_len(item: DraftRequest, first: int) -> int:
    return item.start + 1 - first
