"""The offline entry point: LLM(model=...).generate(prompts, params) and .chat(messages)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence, Union

from rooflm.engine.llm_engine import LLMEngine, PromptType
from rooflm.engine.outputs import RequestOutput
from rooflm.lora.request import LoRARequest
from rooflm.sampling_params import SamplingParams


class LLM:
    """Runs batches of prompts through the continuously batched engine.

    LLM() loads the embedded default model (SmolLM2-135M-Instruct). Any engine
    option (block_size, max_num_seqs, num_blocks, enable_prefix_caching, ...)
    may be passed as a keyword.
    """

    def __init__(self, model: Optional[str] = None, dtype: str = "auto", device: str = "auto",
                 load_format: str = "auto", **engine_kwargs):
        self.engine = LLMEngine.from_kwargs(model=model, dtype=dtype, device=device,
                                            load_format=load_format, **engine_kwargs)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); a no-op otherwise."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False, priority: Optional[Sequence[int]] = None,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string or a list of token ids.

        priority: one per prompt, as vLLM's LLM.generate takes it; needs
        scheduling_policy="priority" (lower values are scheduled first) unless all are 0.
        lora_request: the adapter every prompt runs under, or one per prompt (None: the base
        model), as vLLM's; needs enable_lora=True."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        lora_request = list(lora_request)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(lora_request)} LoRA requests for {len(prompts)} prompts")
        # Validate everything before queueing anything, so a bad prompt loses no work.
        for prompt, p, rank in zip(prompts, params, priority):
            self.engine.tokenize(prompt)
            self.engine.check_priority(rank)
        for p in {id(p): p for p in params}.values():
            if p.structured_outputs is not None:
                from rooflm.structured.grammars import check_structured_outputs
                check_structured_outputs(p.structured_outputs)
        # Only the finished outputs are returned: the engine need not build one every step.
        finals: dict[int, SamplingParams] = {}
        for p in params:
            if id(p) not in finals:
                finals[id(p)] = dataclasses.replace(p, output_kind="final")
        params = [finals[id(p)] for p in params]
        ids = []
        try:
            for prompt, p, rank, lora in zip(prompts, params, priority, lora_request):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, priority=rank, lora_request=lora)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (needs enable_sleep_mode=True): free the KV pool and move the
        weights to host memory (level 1) or drop them (level 2) until wake_up()."""
        self.engine.sleep(level)

    def wake_up(self) -> Optional[dict]:
        """Undo sleep(); where the time went (LLMEngine.wake_up), None when awake."""
        return self.engine.wake_up()

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             params: Optional[SamplingParams] = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="requests", unit="req")
        wanted = set(ids)
        while len(final) < len(ids) and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [final[i] for i in ids]
