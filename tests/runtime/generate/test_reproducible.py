"""The same greedy reply for a conversation however its tokens were computed.

- Default mode: Regenerate (and the same prompt sent again) reuses the logits the prompt's
  prefill left, instead of feeding its last token again as a one-token step, whose
  products reduce in another order and flipped a near-tie in the desktop.
- Reproducible mode (``load_model(reproducible=True)``): every path gives a token's logits
  the same bits: one prefill, chunks, one-token steps, a reused cache, 1 or 2 threads.
  Checked on tiny models of several families (float32: oneDNN's product, one row as two) and
  on the default model with its default float16 weights (FBGEMM's product). A float32 run of
  the default model (43 s here) passed too and was left out to keep ``make test`` short.
"""
from __future__ import annotations

import pytest
import torch

from runtime import load_model
from runtime.generate.chat_format import Message
from runtime.generate.events import GenerationSettings
from runtime.generate.session import ChatSession
from tests.runtime.session_helpers import conversation_ids, run_turn
from tests.runtime.tiny_models import VOCAB_SIZE, make_tiny_model

SYS = "You are a helpful assistant. Answer briefly."


def _logits_by_path(model, ids: list[int], splits: list[int], threads: int) -> torch.Tensor:
    """Every position's logits, the tokens fed in pieces of ``splits`` (1 = a decode step)
    on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = model.new_cache(len(ids) + 1)
        out, pos = [], 0
        for n in splits:
            piece = ids[pos : pos + n]
            out.append(model.decode_next(piece[0], cache)[0] if n == 1 else model.logits(piece, cache)[0])
            pos += n
        assert pos == len(ids)
        return torch.cat(out)
    finally:
        torch.set_num_threads(before)


def _assert_paths_agree(model, ids: list[int], *, quick: bool = False) -> None:
    """Logits bit-equal between one prefill on 2 threads and: chunks on 1 thread, one-token steps
    after a prefill on 2, steps first then a prefill, and the last token alone; ``quick``: one
    path of chunks then one-token steps on 1 thread (the default model: ~20 s a path here)."""
    n = len(ids)
    whole = _logits_by_path(model, ids, [n], 2)
    paths = [([5, 17, n - 25, 1, 1, 1], 1)]
    if not quick:
        paths += [([5, 17, n - 22], 1), ([n - 3, 1, 1, 1], 2), ([1] * 12 + [n - 12], 1), ([n - 1, 1], 1)]
    for splits, threads in paths:
        got = _logits_by_path(model, ids, splits, threads)
        assert torch.equal(got, whole), (splits, threads, (got - whole).abs().max().item())


# ---- tiny models ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "gemma3", "qwen2-window"])
def test_tiny_models_give_the_same_logits_on_every_path(tmp_path, family):
    """GQA and multi-head (GPT-2: one query row per KV head, computed as two), soft-capping,
    sliding windows with multi-query attention (the cache drops old slots), q/k/v biases."""
    model = load_model(make_tiny_model(tmp_path, family, max_positions=256), device="cpu", dtype="float32",
                       reproducible=True)
    assert model.reproducible and model.kernels.reproducible
    ids = torch.randint(4, VOCAB_SIZE, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    _assert_paths_agree(model, ids)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "float16"])
def test_tiny_model_weight_dtypes(tmp_path, dtype):
    model = load_model(make_tiny_model(tmp_path, "llama", max_positions=256), device="cpu", dtype=dtype,
                       reproducible=True)
    ids = torch.randint(4, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    _assert_paths_agree(model, ids)


def test_the_default_mode_differs_between_paths(tmp_path):
    """Why the mode exists: without it a one-token step and a prefill disagree in the last bits
    (so the check above can fail)."""
    model = load_model(make_tiny_model(tmp_path, "llama", max_positions=256), device="cpu", dtype="float32")
    ids = torch.randint(4, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = _logits_by_path(model, ids, [40], 2)
    steps = _logits_by_path(model, ids, [30] + [1] * 10, 2)
    assert not torch.equal(whole, steps)
    torch.testing.assert_close(whole, steps, rtol=1e-4, atol=1e-4)


def test_reproducible_refuses_what_it_cannot_keep(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="eager"):
        load_model(path, device="cpu", dtype="float32", decode="static", reproducible=True)
    with pytest.raises(ValueError, match="float32"):
        load_model(path, device="cpu", dtype="float32", compute="bfloat16", reproducible=True)


# ---- the default model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def repro16(default_model_file):
    """The default model as the app loads it (float16 weights) in the reproducible mode."""
    return load_model(default_model_file, device="cpu", reproducible=True)


@pytest.mark.slow
def test_default_model_float16_gives_the_same_logits_on_every_path(repro16):
    assert repro16.dtype == torch.float16 and repro16.kernels.prefill in ("fbgemm-f16", "widen-onednn")
    ids = conversation_ids(repro16, SYS, [Message("user", "Write two lines about the sea, and name a colour.")])
    _assert_paths_agree(repro16, ids, quick=True)


@pytest.mark.slow
def test_a_conversation_from_cache_and_from_scratch_gives_the_same_reply(repro16):
    """Turn 2 on the session that decoded turn 1 (its reply's keys came from one-token steps)
    and on a fresh session that prefills the whole conversation: the same logits, bit for
    bit, and the same greedy reply; Regenerate too."""
    settings = GenerationSettings(max_new_tokens=12)
    warm = ChatSession(repro16, system_prompt=SYS, settings=settings)
    t1 = run_turn(warm, warm.send("What is the capital of France?"))
    t2 = run_turn(warm, warm.send("And of Italy? Answer in one sentence."))
    assert t1.stats.completion_tokens > 0 and t2.stats.reused_tokens > t1.stats.prompt_tokens
    warm_logits = warm.last_logits.clone()

    cold = ChatSession(repro16, system_prompt=SYS, settings=settings)
    cold.messages = [Message("user", "What is the capital of France?"), Message("assistant", t1.text)]
    c2 = run_turn(cold, cold.send("And of Italy? Answer in one sentence."))
    assert c2.stats.reused_tokens == 0
    assert torch.equal(cold.last_logits, warm_logits)
    assert c2.text == t2.text

    again = run_turn(warm, warm.regenerate())
    assert again.text == t2.text


@pytest.mark.slow
def test_default_model_replies_batched_equal_each_alone_bit_for_bit(repro16):
    """Four replies decoded together (continuous batching over the paged cache) give each one's
    logprobs exactly as it decoded alone."""
    from runtime.cache.paged import PagePool
    from runtime.generate.batch import Batcher, ReplyRequest
    from runtime.generate.events import Finish
    from runtime.generate.logits_processors import LogprobsRecorder

    c = repro16.config
    asks = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
            "Who wrote Hamlet?"]
    prompts = [tuple(conversation_ids(repro16, SYS, [Message("user", a)])) for a in asks]

    def run(batch):
        pool = PagePool(c.n_layers, c.n_kv_heads, c.head_dim, dtype=repro16.compute_dtype)
        recorders = [LogprobsRecorder() for _ in batch]
        done = {}
        batcher = Batcher(repro16, pool, max_batch=len(batch),
                          on_events=lambda r, evs: done.update((id(r), e) for e in evs if isinstance(e, Finish)))
        replies = [batcher.add(ReplyRequest(p, max_new_tokens=10, context_limit=512, logits_processors=(rec,)))
                   for p, rec in zip(batch, recorders)]
        batcher.run()
        return [[t.logprob for t in rec.finish(done[id(r)].token_ids)] for r, rec in zip(replies, recorders)]

    together = run(prompts)
    for i, p in enumerate(prompts):
        assert together[i] == run([p])[0] and len(together[i]) >= 3


# ---- the default mode: Regenerate -----------------------------------------------------------
@pytest.mark.slow
def test_regenerate_reuses_the_prompts_logits(default_model):
    """At temperature 0 Regenerate gives the first reply's logits bit for bit (before: its last
    prompt token went through a one-token step, 2e-6 apart, and a near-tie could flip)."""
    s = ChatSession(default_model, system_prompt=SYS, settings=GenerationSettings(max_new_tokens=8))
    first = run_turn(s, s.send("Name a colour of the French flag."))
    logits = s.last_logits.clone()
    again = run_turn(s, s.regenerate())
    assert torch.equal(s.last_logits, logits)
    assert again.text == first.text
    assert (again.stats.reused_tokens, again.stats.prefilled_tokens) == (first.stats.prompt_tokens, 0)
    # an edit then a return to the old text recomputes (the kept logits were for the old prompt)
    run_turn(s, s.edit_last_user("Name a colour of the Italian flag."))
    back = run_turn(s, s.edit_last_user("Name a colour of the French flag."))
    assert back.stats.prefilled_tokens >= 1
