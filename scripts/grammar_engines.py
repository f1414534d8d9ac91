"""Per-token mask cost of three grammar engines on the default model's tokenizer.

Run: .venv/bin/python scripts/grammar_engines.py  (needs llguidance, xgrammar,
outlines-core installed; only llguidance is a dependency of attnchat). For each engine
and schema: the one-off compile time, then the mean and p99 time to fill the next-token
mask over a fixed valid JSON text, token by token. Prints one table.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from runtime import load_model

SCHEMAS = {
    "object": ({"type": "object"}, {"a": 1, "b": "two", "c": [1, 2, 3]}),
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "age", "tags"], "additionalProperties": False},
               {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"]}),
    "nested-enum": ({"type": "object", "properties": {
        "order": {"type": "object", "properties": {"id": {"type": "integer"},
                                                   "status": {"enum": ["open", "shipped", "closed"]},
                                                   "price": {"type": "number"}},
                  "required": ["id", "status", "price"], "additionalProperties": False}},
        "required": ["order"], "additionalProperties": False},
        {"order": {"id": 42, "status": "shipped", "price": 19.5}}),
}


def stats(ts):
    """(first step, median and max of the others) in microseconds."""
    rest = sorted(ts[1:])
    return ts[0] * 1e6, statistics.median(rest) * 1e6, rest[-1] * 1e6


def bench_llguidance(tok, schema, ids):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(lltok, g)
    t_compile = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, lltok.vocab_size)
    ts = []
    for t in ids:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask)
        ts.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return t_tok, t_compile, ts


def bench_xgrammar(tok, schema, ids, V):
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    compiler = xgr.GrammarCompiler(info)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    m = xgr.GrammarMatcher(cg)
    t_compile = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    ts = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        ts.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return t_tok, t_compile, ts


def bench_outlines(tok, schema, ids):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    vocab = Vocabulary.from_pretrained_tokenizer(tok) if hasattr(Vocabulary, "from_pretrained_tokenizer") else None
    if vocab is None:
        eos = tok.eos_token_id
        m = {}
        for s, i in tok.get_vocab().items():
            if i == eos:
                continue
            m.setdefault(tok.convert_tokens_to_string([s]), []).append(i)
        vocab = Vocabulary(eos, m)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(schema)), vocab)
    guide = Guide(index)
    t_compile = time.perf_counter() - t0
    ts = []
    mask = torch.zeros(len(tok), dtype=torch.bool)
    for t in ids:
        t0 = time.perf_counter()
        mask.zero_()
        mask[torch.tensor(guide.get_tokens())] = True  # a mask, as the others give
        ts.append(time.perf_counter() - t0)
        guide.advance(t)
    return t_tok, t_compile, ts


def main():
    torch.set_num_threads(2)
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = load_model(device="cpu")
    tok, V = model.tokenizer, model.config.vocab_size
    rows = []
    for name, (schema, value) in SCHEMAS.items():
        ids = tok.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False)
        for engine, fn in (("llguidance", lambda: bench_llguidance(tok, schema, ids)),
                           ("xgrammar", lambda: bench_xgrammar(tok, schema, ids, V)),
                           ("outlines-core", lambda: bench_outlines(tok, schema, ids))):
            try:
                t_tok, t_compile, ts = fn()
                first, med, worst = stats(ts)
                rows.append((engine, name, len(ids), f"{t_tok:.2f}", f"{t_compile * 1e3:.0f}", f"{first:.0f}",
                             f"{med:.0f}", f"{worst:.0f}"))
            except Exception as e:  # an engine that cannot take the schema: say so
                rows.append((engine, name, len(ids), "-", "-", f"failed: {type(e).__name__}: {str(e)[:60]}", "-"))
    print("engine | schema | tokens | tokenizer s | compile ms | 1st mask us | mask median us | mask max us")
    for r in rows:
        print(" | ".join(map(str, r)))


if __name__ == "__main__":
    main()
