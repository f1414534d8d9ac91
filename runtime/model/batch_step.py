"""One decode step for several sequences at once: one decoder call over a batch of rows.

Must not import Qt. Continuous batching (Yu et al. 2022, "Orca"; vLLM) decodes every running
sequence in one step: the matrix products take the ``B`` new tokens as ``B`` rows, so each
weight is read once per step instead of once per sequence (decode is bound by reading the
weights). Each row has its own position and its own paged KV cache
(:class:`runtime.cache.paged.PagedSequence`): RoPE is gathered per row, and attention runs
per row over that sequence's keys with the same call the one-sequence path makes
(:meth:`runtime.model.attention.Attention._attend`), so a row's attention is the same
computation as alone. Norms, activations and the row-invariant products of the reproducible
mode act on each row alone: there a batched row's logits equal the same sequence decoded
alone bit for bit (a test checks).

The decoder's own ``forward`` stays the path for one sequence (prefill, the static step):
this module reads its modules and adds nothing to them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.model.decoder import Decoder


@torch.inference_mode()
def decode_rows(decoder: Decoder, tokens: Sequence[int], seqs: Sequence) -> torch.Tensor:
    """Logits of ``tokens[b]`` appended to ``seqs[b]`` for every row ``b``, in one step.

    Args:
        decoder: the model's decoder.
        tokens: one token id per sequence, ``B`` of them.
        seqs: ``B`` distinct :class:`runtime.cache.paged.PagedSequence` (or any cache with
            its ``length``, ``start``, ``reserve``, ``update``, ``advance``), each advanced by
            one token.

    Returns:
        float32 logits ``(B, V)``.

    Raises:
        ValueError: ``tokens`` and ``seqs`` of different lengths, none, or a position past the
            model's maximum context (nothing reserved then).
        CacheLimitError: a sequence cannot take one more token (the rows before it keep the
            page they reserved; none has advanced).
    """
    B = len(seqs)
    if B == 0 or len(tokens) != B or len({id(s) for s in seqs}) != B:
        raise ValueError(f"decode_rows needs one token per distinct sequence; got {len(tokens)} tokens, {B} sequences")
    most = decoder.cfg.max_position_embeddings
    positions = [s.length for s in seqs]
    if max(positions) + 1 > most:
        raise ValueError(f"{max(positions) + 1} tokens pass the model's maximum context of {most}")
    for s in seqs:
        s.reserve(1)
    device = decoder.final_norm.weight.device
    ids = torch.tensor(list(tokens), dtype=torch.long, device=device).view(B, 1)
    x = decoder.embed(ids).to(decoder.compute_dtype)  # (B, 1, C)
    if decoder.cfg.embed_scale != 1.0:
        x = x * decoder.cfg.embed_scale
    if decoder.pos_embed is not None:
        rows = decoder.pos_embed.weight.index_select(0, torch.tensor(positions, device=device))  # (B, C)
        x = x + rows.unsqueeze(1).to(decoder.compute_dtype)
    ropes: dict = {}
    for i, block in enumerate(decoder.blocks):
        spec = decoder.layer_ropes[i]
        if spec not in ropes:  # one per variant: cos, sin (B, 1, 1, R), each row at its position
            ropes[spec] = _rope_rows(decoder, i, positions)
        x = x + block.post_attn_norm(_attention(block.attn, block.attn_norm(x), ropes[spec], seqs, i))
        x = x + block.post_mlp_norm(block.mlp(block.mlp_norm(x)))
    for s in seqs:
        s.advance(1)
    return decoder._logits(decoder.final_norm(x))[:, 0]  # (B, V)


def _rope_rows(decoder: Decoder, layer: int, positions: list[int]):
    """cos, sin ``(B, 1, 1, R)``: row ``b`` at ``positions[b]`` (None for GPT-2)."""
    rows = [decoder.rope(layer, p, 1) for p in positions]  # (1, R) each, as the one-sequence path takes them
    if rows[0] is None:
        return None
    return (torch.stack([c for c, _ in rows]).unsqueeze(1), torch.stack([s for _, s in rows]).unsqueeze(1))


def _attention(attn, x: torch.Tensor, rope, seqs: Sequence, layer: int) -> torch.Tensor:
    """The attention layer over ``x (B, 1, C)``: the batched q/k/v projection, then each row's
    write and attention over its own sequence, then the batched output projection."""
    B = x.shape[0]
    H, D = attn.n_heads, attn.head_dim
    q, k, v = attn.project(x, rope)  # (B, H, 1, D), (B, Hkv, 1, D) x 2
    kw = dict(scale=attn.scale, window=attn.window, softcap=attn.softcap)
    ys = []
    for b, s in enumerate(seqs):
        kb, vb = s.update(layer, k[b : b + 1], v[b : b + 1])  # (1, Hkv, n_b, D)
        ys.append(attn._attend(q[b : b + 1], kb, vb, s.start[layer], kw))  # (1, H, 1, D)
    y = torch.cat(ys)  # (B, H, 1, D)
    if attn.head_edit is not None:
        y = attn.head_edit(layer, y)
    return attn.o_proj(y.transpose(1, 2).reshape(B, 1, H * D))  # (B, 1, C)
