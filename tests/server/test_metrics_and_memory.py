"""``GET /metrics`` (Prometheus text, parsed by prometheus_client's own parser) and the
session pool giving idle KV-cache memory back past ``--pool-mib``."""
from __future__ import annotations

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_count_requests_tokens_and_memory(guarded_server):
    client = openai.OpenAI(base_url=guarded_server.base_url, api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    before = _metrics(guarded_server)  # the server is shared: count what this reply adds
    r = client.chat.completions.create(model=model, max_tokens=3, messages=[{"role": "user", "content": "Hello!"}])
    m = _metrics(guarded_server)

    def added(name: str, labels: tuple = ()) -> float:
        return m[(name, labels)] - before.get((name, labels), 0.0)

    assert added("attnchat_completion_tokens_total") == r.usage.completion_tokens
    assert added("attnchat_prompt_tokens_total") == r.usage.prompt_tokens
    assert added("attnchat_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200"))) == 1
    assert added("attnchat_time_to_first_token_seconds_count") == 1
    assert m[("attnchat_queued", ())] == 0 and m[("attnchat_busy", ())] == 0
    # The reply's cache (256-token chunks: 256 x 46,080 bytes = 11.25 MiB) passed the
    # 1 MiB pool budget, so it was freed once the reply ended.
    assert m[("attnchat_kv_allocated_bytes", ())] == 0


def test_head_and_get_health(guarded_server):
    base = guarded_server.base_url.removesuffix("/v1")
    assert httpx.head(base + "/health", timeout=30).status_code == 200
    assert httpx.get(base + "/health", timeout=30).json()["status"] == "ok"
