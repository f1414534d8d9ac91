"""Constrained decoding: at each step only the tokens that keep the output valid under a
grammar (a JSON schema) may be sampled.

The grammar engine is llguidance (guidance-ai/llguidance, on PyPI): chosen by measuring
the per-token mask cost of llguidance, xgrammar and outlines-core on the default model's
tokenizer (see the README, "Serving over HTTP"). Everything engine-specific lives here;
the session only sees a :data:`runtime.generate.events.LogitsProcessor`.

The token bitmask (``(ceil(V / 32),)`` int32, bit ``i % 32`` of word ``i // 32`` set when
token ``i`` is allowed) is allocated once per reply, filled by the engine on the CPU at
each step and applied to the logits in place on their own device (a bool row built with
one shift). A reply without a grammar makes no :class:`GrammarProcessor`, so it pays
nothing. Must not import Qt.
"""
from __future__ import annotations

import logging
import math
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from runtime.generate import json_bounds
from runtime.generate.json_finite import NoFiniteValue, check_finite

log = logging.getLogger("attnchat.constrained")

__all__ = ["Grammar", "GrammarCompiler", "GrammarError", "GrammarProcessor", "compiler_for", "schema_of"]

#: JSON with no free whitespace (``{"a":1}``): a small model left free to add whitespace
#: can spend its whole budget on newlines and spaces. No ``\u`` escapes: six characters for
#: one (:data:`runtime.generate.json_bounds.ESCAPES`).
_COMPACT = {"whitespace_flexible": False, "json_allowed_escapes": json_bounds.ESCAPES}


class GrammarError(ValueError):
    """A schema the grammar engine cannot take (one sentence: what, and what to change)."""


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar, checked against the tokenizer; make a processor per reply.

    Attributes:
        source: the llguidance grammar (JSON text).
        compiler: the :class:`GrammarCompiler` that checked it.
        caps: the bounds a JSON schema was generated under (:func:`runtime.generate.json_bounds.fit`).
        max_tokens: the most tokens a value under it takes (:func:`runtime.generate.json_bounds.max_tokens`).
    """

    source: str
    compiler: "GrammarCompiler"
    caps: json_bounds.Caps | None = None
    max_tokens: float | None = None

    def processor(self) -> "GrammarProcessor":
        """A fresh per-reply :class:`GrammarProcessor` (a :data:`runtime.LogitsProcessor`)."""
        return GrammarProcessor(self)

    def matches(self, text: str) -> bool:
        """True when the grammar allows exactly ``text`` (then its end), whatever tokens
        spell it: ``text`` is split by the engine's view of the tokenizer."""
        ll = self.compiler._ll
        matcher = ll.LLMatcher(self.compiler.tokenizer, self.source)
        return matcher.consume_tokens(self.compiler.tokenizer.tokenize_str(text)) and matcher.is_accepting()


class GrammarCompiler:
    """Turns JSON schemas into :class:`Grammar` objects for one tokenizer.

    Building the engine's view of the vocabulary takes 2-3 s for the default model's
    49,152 tokens (measured, ``scripts/grammar_engines.py``), so make one per model
    (:func:`compiler_for`) and keep it.

    Args:
        tokenizer: a transformers fast tokenizer.
        stop_token_ids: the model's end-of-turn ids; the grammar's end is the tokenizer's
            end-of-sequence token when it is one of them, else the first of them (so a
            finished value ends the reply as the model's own end of turn would).
    """

    def __init__(self, tokenizer: Any, stop_token_ids: Sequence[int]):
        import llguidance
        import llguidance.hf

        eos = getattr(tokenizer, "eos_token_id", None)
        stops = sorted(stop_token_ids)
        if eos not in stops and stops:
            eos = stops[0]
        self.eos_token_id = int(eos)
        self._ll = llguidance
        from runtime.weights.gguf.fast_tokenizer import transformers_tokenizer

        # llguidance reads transformers' own class
        self.tokenizer = llguidance.hf.from_tokenizer(transformers_tokenizer(tokenizer), eos_token=self.eos_token_id)

    def json_schema(self, schema: dict[str, Any] | None, *, close: bool = True, budget: int | None = None) -> Grammar:
        """The grammar of compact JSON values valid under ``schema`` (``None``: any JSON object,
        ``json_object``), closed and bounded by :func:`runtime.generate.json_bounds.fit`: objects
        that leave ``additionalProperties`` unset get ``false`` (``close``), numbers at most 15
        digits before the point and 6 after it, arrays, strings and open values capped, and
        with a ``budget`` (tokens) the caps shrunk until the longest value fits it.

        Raises:
            GrammarError: the schema is not a JSON object, has no finite value (a ``$ref``
                cycle with no way out: the grammar could never end,
                :mod:`runtime.generate.json_finite`), or uses what the engine cannot
                constrain (the message names it).
        """
        if schema is not None and not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            check_finite(schema)
        except NoFiniteValue as e:
            raise GrammarError(str(e)) from None
        bounded, caps, size = json_bounds.fit(schema, budget, close=close)
        if budget is not None and size > budget:
            log.info("a reply under this schema may take %s tokens, more than the %d it may: it can end cut", size, budget)
        try:
            source = self._ll.LLMatcher.grammar_from_json_schema(bounded, defaults=_COMPACT)
        except Exception as e:  # the engine's own error types: one line for the client
            raise GrammarError(f"the JSON schema cannot be used: {_first_line(e)}") from None
        return replace(self._checked(source), caps=caps, max_tokens=size)

    def lark(self, grammar: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (``%json {...}`` embeds a JSON schema).

        Raises:
            GrammarError: the grammar does not compile.
        """
        try:
            source = self._ll.LLMatcher.grammar_from_lark(grammar)
        except Exception as e:
            raise GrammarError(f"the grammar cannot be used: {_first_line(e)}") from None
        return self._checked(source)

    def _checked(self, source: str) -> Grammar:
        error = self._ll.LLMatcher.validate_grammar(source, self.tokenizer)  # "" when valid
        if error:
            raise GrammarError(f"the grammar cannot be used: {_first_line(error)}")
        return Grammar(source, self)


def _first_line(e: Any) -> str:
    return (str(e).strip().splitlines() or ["?"])[0][:300]


_compilers: "weakref.WeakKeyDictionary[Any, GrammarCompiler]" = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(model: Any) -> GrammarCompiler:
    """The :class:`GrammarCompiler` of a loaded :class:`runtime.Model` (built on first use, kept)."""
    with _compilers_lock:
        c = _compilers.get(model.tokenizer)  # kept as long as the model's tokenizer lives
        if c is None:
            c = GrammarCompiler(model.tokenizer, model.stop_token_ids)
            _compilers[model.tokenizer] = c
        return c


class GrammarProcessor:
    """A per-reply :data:`runtime.LogitsProcessor`: logits of tokens the grammar forbids
    become -inf, in place.

    Called with the reply's token ids so far: it feeds the engine the ones it has not
    seen, fills the bitmask (allocated once here) and applies it. Once the value is
    complete only the end token is allowed, so the reply ends exactly there.
    """

    def __init__(self, grammar: Grammar):
        c = grammar.compiler
        self._c = c
        self._matcher = c._ll.LLMatcher(c.tokenizer, grammar.source)
        words = math.ceil(c.tokenizer.vocab_size / 32)
        self._bitmask = torch.zeros((1, words), dtype=torch.int32)  # (1, ceil(V/32)), filled per step
        self._seen = 0
        self._shifts: torch.Tensor | None = None

    @property
    def is_accepting(self) -> bool:
        """True when the output so far is a complete value."""
        return self._matcher.is_accepting()

    @torch.inference_mode()  # the decoder's logits are inference tensors: changed in place here
    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        for token in generated[self._seen:]:
            if not self._matcher.consume_token(int(token)):
                log.warning("grammar refused token %d: %s", token, self._matcher.get_error())
        self._seen = len(generated)
        V = logits.shape[-1]
        if self._matcher.is_error():
            allowed = torch.zeros(V, dtype=torch.bool, device=logits.device)
            allowed[self._c.eos_token_id] = True  # a broken matcher ends the reply
        else:
            row = self._bitmask[0]
            self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            allowed = self._unpack(logits.device, V)
        return logits.masked_fill_(~allowed, -math.inf)

    def _unpack(self, device: torch.device, V: int) -> torch.Tensor:
        """The bitmask as a bool row (V,) on ``device`` (ids past the tokenizer's: False)."""
        if self._shifts is None or self._shifts.device != device:
            self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        words = self._bitmask[0].to(device, non_blocking=True)
        bits = ((words.unsqueeze(-1) >> self._shifts) & 1).bool().reshape(-1)  # (32 * words,)
        if bits.shape[0] >= V:
            return bits[:V]
        return torch.cat([bits, bits.new_zeros(V - bits.shape[0])])


def schema_of(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema of an OpenAI ``response_format`` of type ``json_schema`` (``None``
    for ``json_object``). Its objects are closed whatever ``json_schema.strict`` says
    (``strict: false`` is langchain's default, not a wish for invented keys: with objects
    left open the default model added keys until ``max_tokens``); a schema that
    wants more keys says ``additionalProperties``.

    Raises:
        GrammarError: no ``json_schema.schema`` object where one is needed.
    """
    if response_format.get("type") == "json_object":
        return None
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise GrammarError("'response_format.json_schema' must be an object with a 'schema' object")
    return spec.get("schema") or {"type": "object"}
