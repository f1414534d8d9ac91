"""The KV-cache panel's readout: its figures in words (HTML for a rich-text label).

Plain functions of plain data (the panel's :class:`~desktop.panels.kv.series.KVSeries`, the
model's info dict, numbers): no widgets. Must not import torch.
"""
from __future__ import annotations

from desktop.panels.kv.series import KVSeries

__all__ = ["OTHER_MODEL", "before_a_cache", "figures", "kept_line", "last_reply_text", "window_note"]

MIB = 2**20
#: Said when the open conversation's replies came from another model than the loaded one.
OTHER_MODEL = ("This model has not read this conversation yet (its replies came from another model): "
               "the cache is empty until your next message, which reads the conversation again.")


def window_note(model: dict | None, per_token: int) -> str:
    """``", 6,144 past the 512-token window (15 of 18 layers slide)"`` for a model with
    sliding-window layers, else ``""``."""
    windows = list((model or {}).get("layer_windows") or [])
    sliding = [w for w in windows if w]
    if not sliding or not per_token:
        return ""
    full = len(windows) - len(sliding)
    return (f", {per_token * full // len(windows):,} past the {min(sliding):,}-token window "
            f"({len(sliding)} of {len(windows)} layers slide)")


def last_reply_text(stats: dict | None) -> str:
    """A reply's figures, marked as the last reply's, when no cache of its conversation exists
    now (after a restart, or a change of the cache settings); "" for none."""
    if not stats:
        return ""
    kv = stats.get("kv_cache") or {}
    ctx = int(stats.get("context_limit") or 0)
    return ("No KV cache for this conversation yet: your next message reads it again with the current "
            f"settings.<br><i>Its last reply's cache</i> ({stats.get('stale_why') or 'an earlier run, or other settings'}): "
            f"{int(kv.get('tokens', 0)):,} tokens" + (f" of {ctx:,}" if ctx else "")
            + (f", {kv['dtype']}" if kv.get("dtype") else "")
            + (f", allocated {int(kv['allocated_bytes']) / MIB:,.2f} MiB" if kv.get("allocated_bytes") else "") + ".")


def before_a_cache(*, model: dict | None, other_model: bool, last_reply: dict | None, per_token: dict[str, int],
                   limit: int, limit_bytes: int | None, next_dtype: str) -> str:
    """No cache of the open conversation: why, this model's bytes per token in each dtype,
    and the limits the next reply gets (``limit`` tokens, ``limit_bytes``)."""
    if not model:
        return "No model is loaded: the chart shows its KV cache once one is."
    head = OTHER_MODEL if other_model else last_reply_text(last_reply) or "No reply yet in this conversation."
    if per_token:
        head += (f" This model's cache: {per_token['float32']:,} bytes per token in float32, "
                 f"{per_token['16-bit']:,} in 16-bit"
                 + (f", {per_token['int8']:,} in int8 (with its scales)." if per_token.get("int8") else "."))
    if limit:
        # The dtype too before any reply: the float32 figure came first and the model's own
        # (float16 for a GGUF's blocks on the CPU, as Settings' "auto" says) was nowhere.
        what = f"Next reply: {next_dtype} cache, context" if next_dtype and next_dtype != "auto" else "Context"
        head += (f"<br>{what} limit {limit:,} tokens"
                 + (f"; memory limit {limit_bytes / MIB:,.1f} MiB." if limit_bytes else "."))
    return head


def figures(s: KVSeries, limit: int, limit_bytes: int | None, *, window_note: str, policy_line: str,
            event_color: str) -> str:
    """The cache now (``s.now()``, a prompt being read included): tokens of the limit, bytes,
    the dtype, what the overflow policy does next, the last truncation or eviction."""
    tokens, used, allocated = s.now()
    pct = f" ({100 * tokens / limit:.0f}%)" if limit else ""
    lines = [
        f"<b>{tokens:,}</b> / {limit:,} tokens{pct}" if limit else f"<b>{tokens:,}</b> tokens",
        f"used {used / MIB:,.2f} MiB ({used:,} bytes), allocated {allocated / MIB:,.2f} MiB"
        + (f" of a {limit_bytes / MIB:,.1f} MiB limit" if limit_bytes else ""),
        f"{s.bytes_per_token:,} bytes per token ({s.dtype})" + window_note,
    ]
    if s.prefill:
        done, total = int(s.prefill.get("done", 0)), int(s.prefill.get("total", 0))
        lines.insert(0, f"Reading the prompt: {done:,} of {total:,} tokens"
                        + (f" ({100 * done / total:.0f}%)" if total else "") + ".")
    if policy_line:
        lines.append(policy_line)
    if s.events:
        before, after, kind = s.events[-1]
        lines.append(f"<span style='color:{event_color}'>Last {kind}: {before - after:,} tokens "
                     f"at {before:,} (now {tokens:,}).</span>")
    return "<br>".join(lines)


def kept_line(s: KVSeries, policy: str) -> str:
    """Under a cache policy: ``"Cache policy h2o keeps 512 of 1,830 tokens (1,318 evicted):
    6.0 of 21.4 MiB, 28 % of the full cache."``."""
    if not s.tokens:
        return f"Cache policy {policy}: nothing evicted yet."
    tokens, used, full = s.tokens[-1], s.used[-1], s.full[-1]
    if not s.evicted:
        return f"Cache policy {policy}: nothing evicted yet ({tokens:,} tokens cached)."
    share = f", {100 * used / full:.0f}\u00a0% of the full cache" if full else ""
    line = (f"Cache policy {policy} keeps <b>{s.held:,}</b> of {tokens:,} tokens ({s.evicted:,} evicted): "
            f"{used / MIB:,.2f} of {full / MIB:,.2f} MiB{share}; the model no longer sees the evicted ones.")
    allocated = s.allocated[-1] if s.allocated else 0
    if allocated > used and s.bytes_per_token:
        # "allocated 22.50 MiB" beside a 256-token budget read as the policy not keeping it: the
        # cache evicts after each forward, so it grew past the budget by the chunk it was reading.
        line += (f" Allocated stays at {allocated / MIB:,.2f} MiB ({allocated // s.bytes_per_token:,} tokens' "
                 "room): the cache evicts after each forward pass, so it grew past the budget while it read "
                 "a chunk of the prompt, and keeps that room for the next one.")
    return line
