"""Structured outputs: grammars compiled by llguidance, one matcher per constrained sequence,
token masks applied to the logits before sampling (and at every speculative position)."""
from pagellm.structured.grammar import StructuredOutputError, compile_grammar
from pagellm.structured.matcher import Constraint, GrammarBackend, Masks, batch_masks, mask_rows

__all__ = ["Constraint", "GrammarBackend", "StructuredOutputError", "batch_masks",
           "compile_grammar", "Masks", "mask_rows"]
