"""Structured outputs: grammars that constrain what a request may generate.

One role per file:
  grammars.py   a request's constraint (StructuredOutputsParams) -> an xgrammar Grammar; its
                errors as InvalidRequest naming the field (the API's check before admission)
  compiler.py   the engine's grammar compiler: the tokenizer's vocabulary, a cache of compiled
                grammars keyed by the constraint, and a worker thread that compiles off the
                engine's step loop
  matcher.py    per-sequence matcher state, and the batched fill of a step's token bitmask
  bitmask.py    the bitmask's layout and its application to the logits on the device (torch
                only: the sampler imports it without xgrammar)

xgrammar is imported lazily, so an engine that never sees a constraint never loads it.
"""
