"""The engine's grammar compiler: constraints compile in a worker thread, cached by constraint.

A compile against a 128k vocabulary takes tens to hundreds of milliseconds. It never
runs on the engine's step loop: add_request hands the constraint to a worker thread and
returns at once; the scheduler leaves a request whose grammar is not ready in the
waiting queue and admits the ones behind it (see the scheduler), so no request
waits on another's compile and no step waits on any. Equal constraints (the same
StructuredOutputsParams.key) share one compile: the cache holds the future, so a second
request that arrives mid-compile waits on the same one.

The tokenizer's vocabulary (xgrammar's TokenizerInfo, ~0.2 s for 49k tokens) is built on
the worker too, by the first compile. xgrammar releases the GIL while it compiles (measured:
a 40-field schema compiled for 0.9 s on a worker while the main thread's loop never paused
longer than the machine's usual 20 ms jitter), so the step loop keeps its pace.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from rooflm.sampling_params import StructuredOutputsParams
from rooflm.structured.grammars import build_grammar, error_message
from rooflm.structured.matcher import SequenceGrammar

logger = logging.getLogger(__name__)

# Compiled grammars kept; a JSON-schema grammar is tens of kB to a few MB.
DEFAULT_CACHE_SIZE = 256


class RequestGrammar:
    """One request's compiled grammar, possibly still compiling."""

    def __init__(self, future: Future):
        self._future = future

    @property
    def ready(self) -> bool:
        """Compiled: the request can be scheduled. A failed compile is never ready; the
        engine finishes such a request (LLMEngine._reap_failed_grammars)."""
        return self._future.done() and self._future.exception() is None

    @property
    def done(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> Optional[str]:
        if not self._future.done() or self._future.exception() is None:
            return None
        return error_message(self._future.exception())

    def new_matcher(self) -> SequenceGrammar:
        return SequenceGrammar.new(self._future.result())


class GrammarCompiler:
    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int],
                 max_workers: Optional[int] = None, cache_size: int = DEFAULT_CACHE_SIZE):
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_size = cache_size
        if max_workers is None:
            # Several workers, so that one long compile does not hold up the next request's
            # (xgrammar releases the GIL while it compiles).
            max_workers = max(2, min(8, os.cpu_count() or 2))
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="rooflm-grammar")
        self.num_compiles = 0  # cache misses, for tests and logs

    def submit(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """Start compiling a constraint (or reuse its cached compile); returns at once."""
        key = spec.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return RequestGrammar(future)
        future = self._pool.submit(self._compile, spec)
        self.num_compiles += 1
        self._cache[key] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return RequestGrammar(future)

    def _xgrammar_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer,
                                                          vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                # xgrammar's own cache is off: ours keys by constraint and holds futures.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: StructuredOutputsParams):
        compiler = self._xgrammar_compiler()
        try:
            return compiler.compile_grammar(build_grammar(spec))
        except Exception:
            logger.warning("a %s constraint failed to compile", spec.kind, exc_info=True)
            raise

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
