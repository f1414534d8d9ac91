"""``GET /metrics`` (Prometheus text, parsed by prometheus_client's own parser) and the
session pool giving idle KV-cache memory back past ``--pool-mib``."""
from __future__ import annotations

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_pool(default_model_file):
    """A server whose pool keeps at most 1 MiB of KV cache (~22 tokens of the default model)."""
    s = start_server("--model", str(default_model_file), "--context", "1024", "--pool-mib", "1",
                     "--device", "cpu")
    yield s
    stop_server(s)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_count_requests_tokens_and_memory(small_pool):
    client = openai.OpenAI(base_url=small_pool.base_url, api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, max_tokens=3, messages=[{"role": "user", "content": "Hello!"}])
    m = _metrics(small_pool)
    assert m[("attnchat_completion_tokens_total", ())] == r.usage.completion_tokens
    assert m[("attnchat_prompt_tokens_total", ())] == r.usage.prompt_tokens
    assert m[("attnchat_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] == 1
    assert m[("attnchat_time_to_first_token_seconds_count", ())] == 1
    assert m[("attnchat_queued", ())] == 0 and m[("attnchat_busy", ())] == 0
    # The reply's cache (256-token chunks: 256 x 46,080 bytes = 11.25 MiB) passed the
    # 1 MiB pool budget, so it was freed once the reply ended.
    assert m[("attnchat_kv_allocated_bytes", ())] == 0


def test_head_and_get_health(small_pool):
    base = small_pool.base_url.removesuffix("/v1")
    assert httpx.head(base + "/health", timeout=30).status_code == 200
    assert httpx.get(base + "/health", timeout=30).json()["status"] == "ok"
