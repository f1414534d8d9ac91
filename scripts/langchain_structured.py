"""langchain-openai's ``with_structured_output(method="json_schema")`` against a real
``attnchat serve``, five seeds, with and without ``strict``.

    .venv/bin/python scripts/langchain_structured.py [--model SRC] [--seeds 5] [--max-tokens 200]

The schema is a langchain-like one: a nested array of objects with an enum and a required integer.
Prints one line per run and a summary; exit status 1 unless every run parsed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic import BaseModel  # noqa: E402

from tests.live_server import start_server, stop_server  # noqa: E402


class Item(BaseModel):
    name: str
    kind: Literal["fruit", "vegetable"]
    count: int


class Basket(BaseModel):
    items: list[Item]


ASK = "List three fruits and two vegetables to buy at the market, with how many of each."


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=1.0)
    a = p.parse_args()
    from langchain_openai import ChatOpenAI

    args = ["--device", "cpu"] + (["--model", a.model] if a.model else [])
    server = start_server(*args)
    ok = total = 0
    try:
        import httpx

        model_id = httpx.get(server.base_url + "/models", timeout=30).json()["data"][0]["id"]
        for strict in (None, True):
            for seed in range(a.seeds):
                llm = ChatOpenAI(base_url=server.base_url, api_key="unused", model=model_id, seed=seed,
                                 temperature=a.temperature, max_tokens=a.max_tokens, max_retries=0, timeout=600)
                kw = {} if strict is None else {"strict": strict}
                chain = llm.with_structured_output(Basket, method="json_schema", include_raw=True, **kw)
                t0 = time.perf_counter()
                total += 1
                try:
                    out = chain.invoke(ASK)
                    parsed, raw = out["parsed"], out["raw"]
                    meta = raw.response_metadata
                    used = (meta.get("token_usage") or {}).get("completion_tokens")
                    if parsed is None:
                        raise ValueError(f"not parsed: {out.get('parsing_error')}")
                    ok += 1
                    print(f"strict={strict} seed={seed}: ok, {len(parsed.items)} items, {used} tokens, "
                          f"finish {meta.get('finish_reason')}, {time.perf_counter() - t0:.1f} s: "
                          f"{[(i.name, i.kind, i.count) for i in parsed.items]}", flush=True)
                except Exception as e:  # noqa: BLE001 - a run's failure is the finding
                    print(f"strict={strict} seed={seed}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    finally:
        stop_server(server)
    print(f"{ok} of {total} parsed (max_tokens {a.max_tokens}, temperature {a.temperature})")
    return 0 if ok == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
