"""Grammar service: compiles regex / JSON schema / EBNF with xgrammar (lands with the structured-output issue)."""
