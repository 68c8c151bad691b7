"""An llguidance matcher behind xgrammar's ``GrammarMatcher`` interface, for :mod:`deepinfer.engine.constraints`.

The worker builds one ``LLMatcher`` per grammar text (the template, cached by cache key) and gives each request a
``deep_copy`` of it. The differences from xgrammar it hides:

* llguidance enters an error state, for good, when it consumes a token its grammar refuses: a token is checked
  first (``validate_tokens``; EOS: ``is_accepting``) and a refused one leaves the state unchanged, as in xgrammar;
* llguidance says "stopped" as soon as only EOS can follow; terminated here means EOS was accepted, as in xgrammar
  (and a rollback over it takes back one token fewer in llguidance, which keeps no EOS in its history);
* the mask is filled into the caller's row (the same layout: bit ``t % 32`` of int32 word ``t // 32``); a
  row wider than llguidance's vocabulary gets the extra tokens refused; a matcher that errs while computing
  its mask (a step over the parser limits) allows EOS only, so the request ends instead of stalling, and says
  why (:meth:`LlgMatcher.error`): the constraint set fails the request with that reason.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LlgMatcher", "llg_template"]


def llg_template(tokenizer: Any, grammar: str) -> Any:
    """An ``LLMatcher`` of ``grammar`` (llguidance's grammar text), within the compile's parser limits;
    ValueError if llguidance refuses it."""
    import llguidance

    from deepinfer.grammar.llg import parser_limits

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise ValueError(f"constraint.grammar: llguidance cannot load the grammar: {matcher.get_error()[:300]}")
    return matcher


class LlgMatcher:
    """One request's llguidance matcher (a copy of a template), with xgrammar's matcher methods."""

    def __init__(self, template: Any, eos_token_id: int, vocab_size: int) -> None:
        self.m, self.eos, self.terminated = template.deep_copy(), eos_token_id, False
        self.words = -(-vocab_size // 32)

    def error(self) -> str | None:
        """llguidance's error, once the matcher is in its error state (for good); None while it is not."""
        return self.m.get_error()[:300] if self.m.is_error() else None

    def is_terminated(self) -> bool:
        return self.terminated

    def accept_token(self, token: int) -> bool:
        if self.terminated or self.m.is_error():
            return False
        ok = self.m.is_accepting() if token == self.eos else self.m.validate_tokens([token]) == 1
        if not ok or not self.m.consume_token(token):
            return False
        self.terminated = token == self.eos
        return True

    def rollback(self, k: int) -> None:
        if k > 0 and self.terminated:  # EOS is always the last token accepted; llguidance does not count it
            self.terminated, k = False, k - 1
        if k > 0:
            self.m.rollback(k)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        import llguidance.torch as lt

        if bitmask.shape[1] == self.words:
            lt.fill_next_token_bitmask(self.m, bitmask, index)
        else:
            row = torch.empty((1, self.words), dtype=torch.int32)
            lt.fill_next_token_bitmask(self.m, row, 0)
            n = min(self.words, bitmask.shape[1])
            bitmask[index, :n] = row[0, :n]
            bitmask[index, n:] = 0
        if self.m.is_error():
            bitmask[index] = 0
            bitmask[index, self.eos >> 5] = _bit(self.eos & 31)


def _bit(j: int) -> int:
    """Bit ``j`` of an int32 word as a Python int (bit 31 is the sign)."""
    return -(1 << 31) if j == 31 else 1 << j
