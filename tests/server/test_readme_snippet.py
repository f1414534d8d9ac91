"""The README's Python snippet for the server, run as written against a real ``attnchat serve``
(only its address and key swapped for the shared test server's): it must print a reply."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import openai
import pytest

from tests.live_server import API_KEY

pytestmark = pytest.mark.slow

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_the_readme_openai_snippet_prints_a_reply(server):
    section = README.split("## Serving over HTTP", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'base_url="http://127.0.0.1:8000/v1", api_key="unused-on-loopback"' in snippet
    code = snippet.replace("http://127.0.0.1:8000/v1", server.base_url).replace("unused-on-loopback", API_KEY)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    printed = out.getvalue()
    again = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0).chat.completions.create(
        model=server_model(server), messages=[{"role": "user", "content": "Hi!"}])
    assert printed == again.choices[0].message.content + "\n" and len(printed) > 2, printed  # greedy: the same


def server_model(server) -> str:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0).models.list().data[0].id
