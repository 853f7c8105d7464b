"""Speculative decoding: proposers draft tokens, the target model verifies them in one forward.

    proposer.py   the Proposer interface (DraftRequest in, Proposal out)
    ngram.py      prompt lookup: the continuation of an earlier occurrence of the last n tokens
    draft.py      a small draft model with its own paged KV pool (same block tables)
    replay.py     measurement only: the target's own greedy continuation, a fraction corrupted
    decoder.py    which sequences speculate and how far, proposals after scheduling,
                  acceptance statistics
    loop.py       the device loop: verify steps queued without a host round trip
    strategy.py   the engine's seam: the step strategies (engine/step_strategy.py) of the host
                  path and the device loop
    factory.py    the proposer and the strategy a SpeculativeConfig names

Verification (greedy acceptance and lossless rejection sampling) is a sampling part below the
engine: layers/rejection.py.
"""
