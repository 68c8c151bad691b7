"""Speculative decoding: drafts proposed by a cheap drafter, verified by the target in one step
(docs/speculative_decoding.md).

``acceptance``: which drafts a verify step keeps, exact for greedy, seeded and unseeded sampling; ``verify``: a
verify step's rows sampled as plain decoding samples their positions, then that rule.
"""
