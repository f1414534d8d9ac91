"""The cache-policy evaluation behind ``attnchat cache-eval``: what each policy keeps, measured.

For every policy and budget (a share of the tokens a run reads) on one model:

- needles: a long everyday conversation with one turn that states a code ("the code for my
  locker is 4817") at a given depth; the last user turn asks for it and the reply is
  started ("The code for your locker is"), then decoded greedily. A trial passes when the
  code appears in the next tokens. The full cache's own accuracy is reported: a policy
  can only be judged on a task the full cache passes.
- NLL: a held-out text whose first part is read into the cache; the mean negative
  log-likelihood of its continuation (teacher-forced, fed ``step`` tokens at a time so the
  cache evicts as it would while decoding) minus the full cache's.
- bytes: the KV cache's bytes in use at the end of each run (every layer, sliding ones
  included), against the full cache's.

Everything runs on our own path (:meth:`Model.logits` into a :class:`KVCache` with an
:class:`Evictor`), the prompt in 256-token chunks with an eviction check after each, as a
chat session does. Must not import Qt (the plot imports pyqtgraph when asked for).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field

import torch

from attnchat.bench import cache_eval_texts as texts
from runtime import CACHE_POLICIES, Evictor, Message
from runtime.cache.policies.evictor import DEFAULT_STEP
from runtime.generate.chat_format import encode_messages

#: The policies evaluated by default (every one but "none", which is the reference).
DEFAULT_POLICIES = tuple(p for p in CACHE_POLICIES if p != "none")
DEFAULT_BUDGETS = (0.25, 0.5)
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
PREFILL_CHUNK = 256
ANSWER_TOKENS = 8


@dataclass
class Trial:
    """One needle trial: the prompt's ids, where the needle sits, what must come back."""

    depth: float
    thing: str
    code: str
    ids: list[int]
    needle_at: int  # token offset of the needle turn

    @property
    def token_depth(self) -> float:
        return self.needle_at / len(self.ids)


@dataclass
class Result:
    """One policy at one budget (``policy="none"``: the full cache, ``budget=1.0``)."""

    policy: str
    budget: float
    needle_passed: int = 0
    needle_trials: int = 0
    needle_by_depth: dict = field(default_factory=dict)
    nll: float = 0.0
    nll_delta: float = 0.0
    kv_bytes: float = 0.0
    kv_bytes_full: float = 0.0
    evicted_tokens: float = 0.0
    seconds: float = 0.0
    answers: list = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.needle_passed / max(1, self.needle_trials)

    def to_dict(self) -> dict:
        return dict(asdict(self), accuracy=self.accuracy,
                    kv_share=self.kv_bytes / self.kv_bytes_full if self.kv_bytes_full else None)


def _render(tokenizer, turns: list[tuple[str, str]], final: tuple[str, str]) -> tuple[list[int], list[int]]:
    """Ids of the exchanges ``turns``, then ``final`` (a user message and the start of the reply,
    left open), and the token offset where each exchange starts. Through the chat template when
    the model has one, else as plain "User: ... / Assistant: ..." text."""
    if getattr(tokenizer, "chat_template", None):
        msgs: list[Message] = []
        starts = []
        for u, a in turns:
            starts.append(len(encode_messages(tokenizer, msgs, add_generation_prompt=False)) if msgs else 0)
            msgs += [Message("user", u), Message("assistant", a)]
        ids = encode_messages(tokenizer, msgs + [Message("user", final[0]), Message("assistant", final[1])],
                              continue_final=True)
        return ids, starts
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    text, starts = "", []
    for u, a in turns:
        starts.append(len(bos) + len(tokenizer.encode(text, add_special_tokens=False)) if text else len(bos))
        text += f"User: {u}\nAssistant: {a}\n\n"
    text += f"User: {final[0]}\nAssistant: {final[1]}"
    return bos + list(tokenizer.encode(text, add_special_tokens=False)), starts


def make_trials(tokenizer, depths=DEFAULT_DEPTHS, needles: int = 2, length: int = 1024, seed: int = 0) -> list[Trial]:
    """``len(depths) x needles`` trials; each conversation about ``length`` tokens long."""
    trials = []
    for n in range(needles):
        thing, code = texts.NEEDLES[n % len(texts.NEEDLES)]
        for d in depths:
            rng = random.Random(seed * 1000 + n * 100 + int(d * 100))
            filler = list(texts.FILLER)
            rng.shuffle(filler)
            turns: list[tuple[str, str]] = []
            for ex in filler * 4:  # enough exchanges for ~length tokens
                turns.append(ex)
                ids, _ = _render(tokenizer, turns, texts.question(thing))
                if len(ids) >= length:
                    break
            k = min(len(turns), max(0, round(d * len(turns))))
            turns.insert(k, texts.needle_turn(thing, code))
            ids, starts = _render(tokenizer, turns, texts.question(thing))
            trials.append(Trial(depth=d, thing=thing, code=code, ids=ids, needle_at=starts[k]))
    return trials


class _Tee:
    """Several evictors observing one cache (the part of a prompt every policy reads alike)."""

    def __init__(self, members: dict):
        self.members = members

    def observe(self, cache, layer, q, keys, **kw) -> None:
        for ev in self.members.values():
            ev.observe(cache, layer, q, keys, **kw)

    def cropped(self, cache) -> None:
        for ev in self.members.values():
            ev.cropped(cache)


def _feed(model, cache, ids: list[int], chunk: int, *, all_logits: bool = False) -> torch.Tensor:
    """Feed ``ids`` in chunks, evicting after each; logits of the last token ``(V,)``, or of all ``(T, V)``."""
    rows = []
    for a in range(0, len(ids), chunk):
        out = model.logits(ids[a:a + chunk], cache, last_only=not all_logits)
        rows.append(out[0])
        if cache.evictor is not None:
            cache.evictor.evict(cache)
    return torch.cat(rows) if all_logits else rows[-1][-1]


def branches(model, ids: list[int], configs: list[tuple[str, float]], *, step: int = DEFAULT_STEP, extra: int = 0):
    """For each ``(policy, share)``: ``(config, cache, logits of the last id)`` after reading ``ids``
    with that policy at a budget of ``share * (len(ids) + extra)`` tokens (``extra``: tokens
    the caller feeds after), one config at a time.

    The chunks every config reads alike (up to the first eviction of the smallest budget)
    are read once, with every policy observing; each config then goes on from a copy.
    """
    import copy

    total = len(ids) + extra
    budgets = {c: max(1, round(c[1] * total)) for c in configs}
    shared = model.new_cache(total + PREFILL_CHUNK + step)
    tee = _Tee({c: Evictor(c[0], budgets[c], step=step) for c in configs if c[0] != "none"})
    shared.evictor = tee
    first_due = min([b + step for c, b in budgets.items() if c[0] != "none"], default=total + 1)
    done, row = 0, None
    while done < len(ids):
        row = model.logits(ids[done:done + PREFILL_CHUNK], shared, last_only=True)[0, -1]
        done += PREFILL_CHUNK
        if shared.held_tokens >= first_due:
            break
    shared.evictor = None
    shared.storage.invalidate()  # an int8 cache's scratch: not worth copying
    for c in configs:
        cache = copy.deepcopy(shared)
        if c[0] != "none":
            cache.evictor = copy.deepcopy(tee.members[c])
            cache.evictor.evict(cache)
        last = _feed(model, cache, ids[done:], PREFILL_CHUNK) if done < len(ids) else row
        yield c, cache, last


def needle(model, trial: Trial, cache, row: torch.Tensor) -> tuple[bool, str]:
    """(passed, the answer's text): greedy decoding after ``trial``'s prompt was read into ``cache``."""
    out = []
    for _ in range(ANSWER_TOKENS):
        tok = int(row.argmax())
        if tok in model.stop_token_ids:
            break
        out.append(tok)
        row = _feed(model, cache, [tok], 1)
    text = model.decode(out)
    return trial.code in text.replace(" ", ""), text


def nll(model, ids: list[int], context: int, cache, row: torch.Tensor, step: int = DEFAULT_STEP) -> float:
    """Mean NLL (nats) of ``ids[context:]``, ``ids[:context]`` having been read into ``cache``
    (``row``: the logits after it); the rest is fed ``step`` tokens at a time."""
    rest = _feed(model, cache, ids[context:-1], step, all_logits=True)  # predicts ids[context+1:]
    logits = torch.cat([row[None], rest]).float()
    target = torch.tensor(ids[context:], device=logits.device)
    return float(torch.nn.functional.cross_entropy(logits, target))


def evaluate(model, *, policies=DEFAULT_POLICIES, budgets=DEFAULT_BUDGETS, depths=DEFAULT_DEPTHS, needles: int = 2,
             length: int = 1024, nll_context: int = 768, nll_tokens: int = 256, step: int = DEFAULT_STEP,
             progress=None) -> dict:
    """Every policy at every budget, and the full cache; see the module docstring.

    Returns:
        ``{"full": Result dict, "results": [Result dicts], "trials": [...], "nll_text": {...}}``.
    """
    trials = make_trials(model.tokenizer, depths, needles, length)
    held_out = list(model.tokenizer.encode(texts.HELD_OUT, add_special_tokens=False))
    bos = [model.tokenizer.bos_token_id] if not getattr(model.tokenizer, "chat_template", None) and \
        getattr(model.tokenizer, "bos_token_id", None) is not None else []
    text_ids = (bos + held_out)[: nll_context + nll_tokens]
    if len(text_ids) < nll_context + nll_tokens:
        raise ValueError(f"the held-out text has {len(text_ids)} tokens; lower --nll-context or --nll-tokens")
    runs = [("none", 1.0)] + [(p, b) for b in budgets for p in policies]
    results = {c: Result(*c) for c in runs}
    used: dict = {c: [] for c in runs}
    full_bytes: dict = {c: [] for c in runs}
    evicted: dict = {c: [] for c in runs}

    def account(c, cache, t0):
        used[c].append(cache.used_bytes)
        full_bytes[c].append(cache.bytes.at(cache.length))
        evicted[c].append(cache.evicted)
        results[c].seconds += time.perf_counter() - t0

    for t in trials:
        t0 = time.perf_counter()
        for c, cache, row in branches(model, t.ids, runs, step=step, extra=ANSWER_TOKENS):
            ok, text = needle(model, t, cache, row)
            r = results[c]
            r.needle_trials += 1
            r.needle_passed += ok
            key = f"{t.depth:g}"
            r.needle_by_depth[key] = r.needle_by_depth.get(key, 0) + int(ok)
            r.answers.append(text)
            account(c, cache, t0)
            t0 = time.perf_counter()
        if progress:
            progress(f"needle at depth {t.depth:g} ({t.thing}): " + ", ".join(
                f"{c[0]}@{c[1]:g} {'ok' if results[c].answers[-1] and t.code in results[c].answers[-1].replace(' ', '') else 'missed'}"
                for c in runs))
    t0 = time.perf_counter()
    for c, cache, row in branches(model, text_ids[:nll_context], runs, step=step, extra=nll_tokens):
        results[c].nll = nll(model, text_ids, nll_context, cache, row, step)
        account(c, cache, t0)
        t0 = time.perf_counter()
    full = results[("none", 1.0)]
    for c, r in results.items():
        r.kv_bytes, r.kv_bytes_full = sum(used[c]) / len(used[c]), sum(full_bytes[c]) / len(full_bytes[c])
        r.evicted_tokens = sum(evicted[c]) / len(evicted[c])
        r.nll_delta = r.nll - full.nll
    results = list(results.values())
    return {"full": full.to_dict(), "results": [r.to_dict() for r in results[1:]],
            "trials": [{"depth": t.depth, "token_depth": round(t.token_depth, 3), "thing": t.thing, "code": t.code,
                        "tokens": len(t.ids)} for t in trials],
            "nll_text": {"context_tokens": nll_context, "scored_tokens": nll_tokens}, "step": step,
            "prefill_chunk": PREFILL_CHUNK}


def table(report: dict) -> str:
    """The results as a Markdown table (one row per policy and budget, the full cache first)."""
    full = report["full"]
    lines = ["| policy | budget | needles found | mean NLL change (nats) | KV bytes in use (share of full) | tokens evicted |",
             "|---|---|---|---|---|---|"]
    rows = [full] + sorted(report["results"], key=lambda r: (-r["budget"], r["policy"]))
    for r in rows:
        name = "full cache" if r["policy"] == "none" else r["policy"]
        budget = "-" if r["policy"] == "none" else f"{r['budget']:.0%}"
        delta = f"{r['nll']:.3f} (reference)" if r["policy"] == "none" else f"{r['nll_delta']:+.3f}"
        share = r["kv_bytes"] / r["kv_bytes_full"] if r["kv_bytes_full"] else math.nan
        lines.append(f"| {name} | {budget} | {r['needle_passed']}/{r['needle_trials']} | {delta} | "
                     f"{r['kv_bytes'] / 2**20:.1f} MiB ({share:.0%}) | {r['evicted_tokens']:.0f} |")
    return "\n".join(lines)


def plot(reports: list[dict], path: str, where: str) -> None:
    """A PNG: needle accuracy (left) and NLL change (right) against the budget, one line per
    policy and model (pyqtgraph, offscreen)."""
    import os

    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import pyqtgraph as pg
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])  # noqa: F841 (keeps Qt alive)
    pg.setConfigOptions(background="w", foreground="k", antialias=True)
    win = pg.GraphicsLayoutWidget()
    win.resize(1100, 480)
    win.addLabel(f"cache policies against the full cache ({where})", colspan=2)
    win.nextRow()
    acc = win.addPlot(title="needles found (share of trials)")
    dn = win.addPlot(title="mean NLL change on a held-out continuation (nats)")
    for p in (acc, dn):
        p.setLabel("bottom", "budget (share of the tokens read)")
        p.showGrid(x=True, y=True, alpha=0.3)
    leg = dn.addLegend(offset=(10, 10))
    colours = {"sinks-window": "#1f77b4", "h2o": "#d62728", "snapkv": "#2ca02c", "tova": "#9467bd", "key-norm": "#8c564b"}
    styles = [pg.QtCore.Qt.PenStyle.SolidLine, pg.QtCore.Qt.PenStyle.DashLine]
    for k, rep in enumerate(reports):
        model = rep.get("model_name", f"model {k + 1}")
        for policy in sorted({r["policy"] for r in rep["results"]}):
            rs = sorted((r for r in rep["results"] if r["policy"] == policy), key=lambda r: r["budget"])
            xs = [r["budget"] for r in rs] + [1.0]
            pen = pg.mkPen(colours.get(policy, "k"), width=3, style=styles[k % 2])
            acc.plot(xs, [r["accuracy"] for r in rs] + [rep["full"]["accuracy"]], pen=pen, symbol="o",
                     symbolBrush=colours.get(policy, "k"))
            dn.plot(xs, [r["nll_delta"] for r in rs] + [0.0], pen=pen, symbol="o", symbolBrush=colours.get(policy, "k"),
                    name=f"{policy} ({model})")
    leg.setLabelTextSize("8pt")
    acc.setYRange(0, 1.05)
    win.show()
    app.processEvents()
    if not win.grab().save(path):
        raise OSError(f"could not write the plot to {path}")
    win.close()
