"""The grammar service: compiles regex / JSON schema / EBNF / structural-tag grammars with xgrammar, in a pool of
child processes with time and memory limits, behind a size-capped compile cache.

- :mod:`.pool`: :class:`~.pool.CompilerPool` over :mod:`.process` (one compile process, ``python -m
  services.grammar.child``);
- :mod:`.service`: the gRPC servicer and ``run_grammar``; :mod:`.metrics`; ``python -m services.grammar``.

What the balancer and the workers share with it (the grammar spec, limits, the in-process compiler, the client,
the tokenizer view) is :mod:`deepinfer.grammar`.
"""
