"""A scripted fake engine for fast GUI tests: a fake model and a ChatSession look-alike
that yields the runtime's real event types from the worker thread, one piece per step."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from runtime import Finish, Message, PrefillProgress, TextPiece, TurnStats

REPLY = ["Here", " is", " a", " list", ":\n\n", "- one\n", "- two\n\n", "```python\n", "print('hi')\n", "```\n"]


def fake_load(source: str, device: str):
    config = SimpleNamespace(max_position_embeddings=8192, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
    return SimpleNamespace(name="fake-model", path=Path(source or "fake.gguf"), device="cpu", dtype="float32",
                           config=config, load_seconds=0.01, tokenizer=FakeTokenizer())


class FakeTokenizer:
    """One token per word."""

    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split())))


class FakeSession:
    """Like runtime.ChatSession: ``messages``, ``send``/``regenerate``, ``cancel``."""

    instances: list["FakeSession"] = []

    def __init__(self, settings, script=None, delay=0.002, fail=None):
        self.settings = settings
        self.system_prompt = None
        self.messages: list[Message] = []
        self.script = list(script or REPLY)
        self.delay = delay
        self.fail = fail
        self._cancel = threading.Event()
        self.cancel_seen_at: float | None = None
        FakeSession.instances.append(self)

    def cancel(self) -> None:
        self._cancel.set()

    context_limit = 8192

    def prompt_ids(self) -> list[int]:
        """One id per character of the messages (as ``prompt`` below counts them)."""
        return list(range(sum(len(m.content) for m in self.messages)))

    def send(self, text):
        self.messages.append(Message("user", text))
        return self._generate()

    def regenerate(self):
        while self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
        return self._generate()

    def _generate(self):
        self._cancel.clear()
        if self.fail is not None:
            raise self.fail
        prompt = sum(len(m.content) for m in self.messages)
        yield PrefillProgress(0, prompt)
        yield PrefillProgress(prompt, prompt)
        t0 = time.perf_counter()
        shown, reason = [], "stop"
        for piece in self.script:
            if self._cancel.is_set():
                reason = "cancelled"
                self.cancel_seen_at = time.perf_counter()
                break
            time.sleep(self.delay)  # one "decode step"
            shown.append(piece)
            yield TextPiece(piece)
        text = "".join(shown)
        dt = max(time.perf_counter() - t0, 1e-6)
        stats = TurnStats(prompt_tokens=prompt, prefilled_tokens=prompt, completion_tokens=len(shown),
                          ttft_s=0.01, decode_tokens_per_s=len(shown) / dt, context_limit=8192,
                          kv_cache={"tokens": prompt + len(shown), "bytes_per_token": 64})
        if text:
            self.messages.append(Message("assistant", text))
        yield Finish(reason, text, stats)


def fake_session_factory(script=None, delay=0.002, fail=None):
    def make(model, system, settings):
        return FakeSession(settings, script, delay, fail)
    return make
