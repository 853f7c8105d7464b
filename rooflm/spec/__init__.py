"""Speculative decoding: proposers draft tokens, the target model verifies them in one forward.

    proposer.py   the Proposer interface (DraftRequest in, Proposal out)
    ngram.py      prompt lookup: the continuation of an earlier occurrence of the last n tokens
    draft.py      a small draft model with its own paged KV pool (same block tables)
    replay.py     measurement only: the target's own greedy continuation, a fraction corrupted
    rejection.py  greedy acceptance and lossless rejection sampling, beside layers/sampler.py
    decoder.py    the engine's seam: which sequences speculate and how far, proposals after
                  scheduling, acceptance statistics
"""
