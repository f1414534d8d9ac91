"""Choosing the next token from a vector of logits: pure functions, no state but a generator.

The chain follows the order most local runtimes use (llama.cpp, vLLM, transformers):
repetition penalty -> temperature -> top-k -> top-p -> min-p -> softmax -> draw.
Every filter takes logits of shape (V,) and returns a new tensor of the same shape in
which removed entries are -inf; none of them mutates its input, and each always keeps
the highest logit, so the softmax at the end can never see an all -inf row (no NaN).

This module imports torch only; it must not import Qt (PySide6, pyqtgraph).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "SamplingParams",
    "Sampler",
    "apply_repetition_penalty",
    "apply_temperature",
    "make_generator",
    "min_p_filter",
    "sample_next",
    "sample_next_tensor",
    "top_k_filter",
    "top_p_filter",
]

TokenIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 turns it off.
    top_p: nucleus mass in (0, 1]; 1 turns it off.
    min_p: keep tokens with p >= min_p * p_max, in [0, 1); 0 turns it off.
    repetition_penalty: > 0; 1 turns it off, > 1 discourages tokens already seen.
    seed: seeds one torch.Generator per reply (same seed => same text); None draws
        from torch's global generator.

    Raises ValueError (one sentence: what was wrong and the allowed range).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}."
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}.")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}.")
        if not (0.0 <= self.min_p < 1.0):
            raise ValueError(f"min_p must be in [0, 1) (0 turns it off), got {self.min_p!r}.")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                "repetition_penalty must be a finite number > 0 (1 turns it off), "
                f"got {self.repetition_penalty!r}."
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0


def apply_repetition_penalty(
    logits: torch.Tensor, previous_ids: TokenIds, penalty: float
) -> torch.Tensor:
    """Penalise tokens that already occurred: logits (V,) float -> new tensor (V,).

    For each distinct id in previous_ids (any number of repeats counts once), a positive
    logit is divided by penalty and a negative one multiplied by it, so penalty > 1 always
    makes the token less likely. Source: CTRL, Keskar et al. 2019, arXiv:1909.05858, §4.1
    (the sign rule is the one transformers' RepetitionPenaltyLogitsProcessor uses, since
    dividing a negative logit would raise it). Raises ValueError on ids outside [0, V).

    Ids given as a Python sequence are checked on the host, so on a GPU nothing waits
    for the device; ids already in a tensor are checked there (one sync).
    """
    if penalty == 1.0 or len(previous_ids) == 0:
        return logits
    V = logits.shape[-1]
    if isinstance(previous_ids, torch.Tensor):
        ids = torch.unique(previous_ids.to(device=logits.device, dtype=torch.long).reshape(-1))
        bad = ids.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= V)
    else:
        distinct = sorted(set(int(i) for i in previous_ids))
        bad = distinct[0] < 0 or distinct[-1] >= V
        ids = torch.tensor(distinct, dtype=torch.long).to(logits.device, non_blocking=True)
    if bad:
        raise ValueError(f"previous_ids must lie in [0, {V}), got {torch.as_tensor(previous_ids).tolist()[:8]}...")
    seen = logits[ids]
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    out = logits.clone()
    out[ids] = seen
    return out


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Scale logits (V,) by 1/temperature, temperature > 0 (greedy is handled by sample_next).

    softmax(logits / T): T < 1 sharpens the distribution, T > 1 flattens it.
    Raises ValueError for temperature <= 0.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 here (0 is greedy), got {temperature!r}.")
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of (V,), set the rest to -inf; k <= 0 or k >= V is a no-op.

    Tokens tied with the k-th largest value are all kept (as in transformers'
    TopKLogitsWarper), so the result never depends on how a sort breaks ties and the
    argmax always survives. Source: Fan et al. 2018, "Hierarchical Neural Story
    Generation", arXiv:1805.04833.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[..., -1:]  # (1,)
    return logits.masked_fill(logits < kth, -math.inf)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter over logits (V,): keep the smallest set of most likely tokens whose mass >= p.

    A token (in descending order of probability) is kept when the mass of the tokens
    before it is < p, so the most likely token always survives. One sort, only when p < 1.
    Source: Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration",
    arXiv:1904.09751.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # (V,) exclusive prefix sum
    remove_sorted = mass_before >= p
    remove_sorted[..., 0] = False  # guard against rounding when p is tiny
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, -math.inf)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens of logits (V,) with p >= min_p * p_max; min_p <= 0 is a no-op.

    Computed in log space without a softmax: p_i / p_max = exp(l_i - l_max), so the
    test is l_i >= l_max + log(min_p); the argmax always survives. Source: Nguyen et al.
    2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM Outputs",
    arXiv:2407.01082.
    """
    if min_p <= 0.0:
        return logits
    threshold = logits.max(dim=-1, keepdim=True).values + math.log(min_p)
    return logits.masked_fill(logits < threshold, -math.inf)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A torch.Generator on device seeded with seed, or None (torch's global RNG) when seed is None.

    The generator must live on the same device as the probabilities it draws from.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


def sample_next_tensor(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    previous_ids: TokenIds | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_next` without leaving the logits' device: nothing here waits for it.

    Returns:
        (the token id, a 0-d int64 tensor; a 0-d bool tensor, True when the logits were
        valid: finite or -inf, no NaN, at least one finite entry), both on the logits'
        device, so that one small copy brings both to the host.
    """
    if logits.dim() != 1:
        raise ValueError(f"logits must have shape (V,), got {tuple(logits.shape)}.")
    x = logits.float()
    # One reduction checks everything: max is NaN if any entry is NaN, +inf if any is
    # +inf, and -inf only if all are -inf.
    top, top_id = torch.max(x, dim=0)
    valid = torch.isfinite(top)
    penalize = previous_ids is not None and params.repetition_penalty != 1.0
    if penalize:
        x = apply_repetition_penalty(x, previous_ids, params.repetition_penalty)
    if params.greedy:
        return (torch.argmax(x) if penalize else top_id), valid
    x = apply_temperature(x, params.temperature)
    x = top_k_filter(x, params.top_k)
    x = top_p_filter(x, params.top_p)
    x = min_p_filter(x, params.min_p)
    # Invalid logits would make multinomial fail on the device: draw from a harmless
    # row instead and let the caller raise on ``valid``.
    probs = torch.softmax(torch.where(valid, x, 0.0), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0], valid


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    previous_ids: TokenIds | None = None,
) -> int:
    """Choose the next token id from logits of shape (V,) (any float dtype; computed in float32).

    Greedy (temperature 0) is the argmax after the repetition penalty. Otherwise:
    repetition penalty -> temperature -> top-k -> top-p -> min-p -> softmax ->
    torch.multinomial(generator). Runs on the logits' device (a GPU's logits are
    sampled there: :func:`sample_next_tensor`) and brings the id to the host in one
    small copy. Returns an int in [0, V) whose logit survived every filter. Raises
    ValueError if logits is not 1-D, holds NaN or +inf, or is all -inf.
    """
    token, valid = sample_next_tensor(logits, params, generator=generator, previous_ids=previous_ids)
    token_id, ok = torch.stack((token, valid.long())).tolist()  # the one device -> host copy
    if not ok:
        raise ValueError("logits must be finite or -inf (no NaN, no +inf) with at least one finite entry.")
    return int(token_id)


class Sampler:
    """SamplingParams plus one generator, seeded once per reply: same seed => same token ids.

    Make one Sampler per reply (or call reset() before each). The generator is created
    lazily on the device of the first logits it sees.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None

    def reset(self) -> None:
        """Re-seed: the next call starts the same sequence of draws again."""
        self._generator = None

    def __call__(self, logits: torch.Tensor, previous_ids: TokenIds | None = None) -> int:
        """The next token id for logits (V,); previous_ids feed the repetition penalty."""
        if self.params.seed is not None and not self.params.greedy:
            if self._generator is None or self._generator.device != logits.device:
                self._generator = make_generator(self.params.seed, logits.device)
        return sample_next(logits, self.params, generator=self._generator, previous_ids=previous_ids)
