"""What a chat session is told and what it tells: generation settings, and the typed events
of a reply (prefill progress, text pieces, figures, the finish) with its figures.

Must not import Qt.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence, Union

import torch

from runtime.cache.policies import CACHE_POLICIES
from runtime.generate.context import OVERFLOW_POLICIES
from runtime.generate.sampling import SamplingParams

#: A per-step hook on the logits: ``(reply token ids so far, logits (V,) float) -> logits (V,)``,
#: called before sampling at every step of a reply (as transformers' ``LogitsProcessor``).
#: It may change the logits in place and return them (a grammar's token mask sets
#: disallowed tokens to -inf); it must not keep them past the call. Make one per reply.
LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]


#: The role of a message that is plain text to continue, without a chat template.
TEXT_ROLE = "text"


@dataclass(frozen=True)
class GenerationSettings:
    """How a session generates.

    Attributes:
        sampling: sampling parameters (temperature 0 = greedy).
        max_new_tokens: most tokens per reply.
        stop_strings: texts that end a reply (not shown).
        context_limit: context window in tokens (``None``: the model's maximum).
        overflow: ``"stop"``, ``"truncate-middle"`` or ``"rolling"``.
        sink_tokens: first tokens the rolling policy always keeps.
        keep_system_prompt: rolling keeps the system prompt with the sinks: the sinks are
            then at least the tokens up to the first message (the system prompt the
            template renders, the settings' or its own), so the model never loses its
            instructions; not when that is more than half the context (then only
            ``sink_tokens``, and ``TurnStats.system_kept`` says so).
        prefill_chunk: tokens per prefill step (progress and cancel granularity).
        cache_dtype: KV-cache dtype name (``None``: the model's compute dtype).
        cache_limit_bytes: cap on the KV cache's allocated bytes (``None``: none).
        logits_processors: :data:`LogitsProcessor` hooks applied in order before each
            sampling step (structured output, penalties, logprobs); none by default, and
            then the decode loop does nothing extra.
        tools: function descriptions (OpenAI's ``tools`` entries, JSON-like dicts) the
            chat template renders in the prompt (its ``tools`` variable); none by default.
        cache_policy: which tokens the KV cache evicts once it holds its budget
            (:data:`runtime.cache.policies.CACHE_POLICIES`; ``"none"``: it keeps them all).
            The conversation may then run to ``context_limit`` tokens with only the budget
            cached; the overflow policy acts at the context limit (not ``rolling``, itself
            an eviction).
        cache_budget: tokens each full-attention layer keeps under a cache policy.
        cache_budget_bytes: the same as bytes of the whole cache (sliding layers counted
            at their full window); with both, the smaller. A policy needs one of them.

    Raises:
        ValueError: values out of range (one sentence, with the allowed range).
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 512
    stop_strings: tuple[str, ...] = ()
    context_limit: int | None = None
    overflow: str = "truncate-middle"
    sink_tokens: int = 4
    keep_system_prompt: bool = True
    prefill_chunk: int = 256
    cache_dtype: str | None = None
    cache_limit_bytes: int | None = None
    logits_processors: tuple[LogitsProcessor, ...] = ()
    tools: tuple[dict, ...] = ()
    cache_policy: str = "none"
    cache_budget: int | None = None
    cache_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max new tokens must be at least 1; got {self.max_new_tokens}")
        if self.context_limit is not None and self.context_limit < 1:
            raise ValueError(f"the context length must be a positive number of tokens; got {self.context_limit}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"unknown overflow policy {self.overflow!r}; use one of {', '.join(OVERFLOW_POLICIES)}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink tokens must be 0 or more; got {self.sink_tokens}")
        if self.prefill_chunk < 1:
            raise ValueError(f"the prefill chunk must be at least 1 token; got {self.prefill_chunk}")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"unknown cache policy {self.cache_policy!r}; use one of {', '.join(CACHE_POLICIES)}")
        if self.cache_policy != "none":
            if self.overflow == "rolling":
                raise ValueError(f"the {self.cache_policy} cache policy evicts by itself; use overflow stop or "
                                 "truncate-middle with it (rolling is StreamingLLM's own eviction)")
            if self.cache_budget is None and self.cache_budget_bytes is None:
                raise ValueError(f"the {self.cache_policy} cache policy needs a budget (tokens or bytes)")
        if (self.cache_budget is not None and self.cache_budget < 1) or \
                (self.cache_budget_bytes is not None and self.cache_budget_bytes < 1):
            raise ValueError("the cache budget must be positive")


@dataclass
class TurnStats:
    """Figures of one reply (the command line's JSON fields). Times in seconds."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    completion_tokens: int = 0
    dropped_tokens: int = 0
    #: Tokens of earlier replies rebuilt from their text (edited or imported replies, or
    #: ones a stop string cut) instead of the ids the model wrote; those may differ from
    #: what the cache holds, so the prefix reuse can end early there.
    retokenized_tokens: int = 0
    #: Tokens of the conversation the KV cache no longer holds at the end of the reply
    #: (a cache policy's evictions, or the rolling policy's), counted per full-attention
    #: layer; the model does not see them. Not the same as ``dropped_tokens``, which the
    #: conversation lost before it was read (truncate-middle).
    evicted_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    context_limit: int = 0
    kv_cache: dict = field(default_factory=dict)
    #: CPU threads decode steps ran on at the end of the reply and the most it may use
    #: (:mod:`runtime.kernels.threads`: fewer while another program keeps a core busy); 0 off the CPU.
    decode_threads: int = 0
    max_threads: int = 0
    #: Rolling overflow: the tokens kept at the start (the sinks: the system prompt's with
    #: ``keep_system_prompt``) and whether the system prompt is among them. Rolling and
    #: truncate-middle: how many of the conversation's messages (from the first) the model no
    #: longer sees at all (evicted from the cache; left out of the prompt), and which of the two
    #: (``unseen_policy``: "rolling", "truncate-middle", or "" when none).
    sink_tokens: int = 0
    system_kept: bool = True
    unseen_messages: int = 0
    unseen_policy: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PrefillProgress:
    """``done`` of ``total`` prompt tokens prefilled so far."""

    done: int
    total: int


@dataclass(frozen=True)
class TextPiece:
    """Newly shown reply text (never a broken character, never part of a stop string)."""

    text: str


@dataclass(frozen=True)
class StatsUpdate:
    """Figures so far (after prefill, then every few decoded tokens)."""

    stats: TurnStats


@dataclass(frozen=True)
class Finish:
    """The reply ended: ``reason`` is ``"stop"``, ``"length"``, ``"context"`` or ``"cancelled"``.

    ``token_ids`` are the reply's sampled tokens (the end-of-turn token not included).
    """

    reason: str
    text: str
    stats: TurnStats
    token_ids: tuple[int, ...] = ()


Event = Union[PrefillProgress, TextPiece, StatsUpdate, Finish]
