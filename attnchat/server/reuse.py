"""What one request may reuse of the KV cache an earlier one left (docs/server.md).

No HTTP, no asyncio and no Qt here; :class:`attnchat.server.engine.Engine` applies it to its
pool of sessions. The rule:

    A request reuses a pooled session's cache up to the end of the longest earlier prompt
    of that session it extends (every message of it, exactly), plus the part of the reply
    the model wrote to that prompt that the request repeats token for token; never more.
    Sessions are partitioned by API key: clients with different keys never share one.

So a client that resends a growing conversation reuses all of it; one that strips the
whitespace around the replies it sends back (many do) reuses up to where its copy of a
reply first differs; the same request twice reuses its whole prompt (and, greedy, gets
the same reply: the session keeps the logits its prefill left). Never a partial earlier
*prompt*: reusing a partial match let a client read another's prompt one token at a time
from ``cached_tokens`` (a victim's "My bank PIN is 4817", probed with "...PIN is
4" and "...48", came back with 30 and 31 cached tokens). A reply is readable that way by a
client that knows the whole prompt before it, hence the partition by key. Without a key
the server serves one local user, and any local process that can reach the port is that
user (docs/server.md says what it could learn).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from runtime import TurnStats

#: Turns remembered per pooled session.
TURNS = 16


@dataclass
class Turn:
    """One reply a pooled session wrote: its prompt's length in messages (system included)
    and in tokens, and where the reusable tokens after it end (the reply's last token,
    or sooner where a later request's copy of the reply differed)."""

    messages: int
    prompt_tokens: int
    reuse_end: int


@dataclass
class Owner:
    """What the engine keeps beside a pooled session: whose it is (the partition, an opaque
    label of the API key) and its turns."""

    partition: str = ""
    turns: list[Turn] = field(default_factory=list)

    def longest_turn(self, messages: int) -> Turn | None:
        """The turn with the longest prompt among those a request whose first ``messages``
        messages (system included) equal the session's extends; None if none."""
        return max((t for t in self.turns if t.messages <= messages), key=lambda t: t.messages, default=None)

    def note(self, stats: TurnStats, messages: int, stream_length: int) -> None:
        """After a reply to a prompt of ``messages`` messages: keep the turns whose tokens it
        left in place (the reuse end moved back to where this request's copy differed), add
        its own (its reply reusable up to ``stream_length``)."""
        reused, kept = stats.reused_tokens, []
        if not stats.dropped_tokens:  # a trimmed conversation moved every position
            for t in self.turns:
                if reused >= t.prompt_tokens:
                    kept.append(replace(t, reuse_end=min(t.reuse_end, max(reused, t.prompt_tokens))))
        if stats.prompt_tokens:
            kept.append(Turn(messages, stats.prompt_tokens, stream_length))
        self.turns = kept[-TURNS:]
