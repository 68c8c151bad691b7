"""Grammar service: compiles regex / JSON schema / EBNF / structural-tag grammars with xgrammar, in a pool of
child processes with time and memory limits, behind a size-capped compile cache."""
