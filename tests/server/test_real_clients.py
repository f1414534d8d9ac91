"""litellm and langchain-openai against ``attnchat serve``: their context-window errors
from our overflow wording, langchain's ``bind_tools`` and ``with_structured_output``.

litellm runs with ``LITELLM_LOCAL_MODEL_COST_MAP=True`` so it never reaches the network.
"""
from __future__ import annotations

import json
import os

import pytest
from pydantic import BaseModel

from tests.live_server import API_KEY

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # before litellm is imported

pytestmark = pytest.mark.slow

TOO_LONG = [{"role": "user", "content": "word " * 3000}]  # > the test server's 2,048-token context


@pytest.fixture(scope="module")
def chat(server, model_id):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.base_url, api_key=API_KEY, model=model_id, temperature=0, max_tokens=120,
                      max_retries=0, timeout=120)


def test_litellm_answers_and_raises_its_context_window_error(server, model_id):
    import litellm

    ask = dict(model=f"openai/{model_id}", api_base=server.base_url, api_key=API_KEY, max_tokens=4, num_retries=0)
    r = litellm.completion(messages=[{"role": "user", "content": "Hi!"}], **ask)
    assert r.choices[0].message.content and r.usage.completion_tokens >= 1
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=TOO_LONG, **ask)


def test_langchain_raises_its_context_overflow_error(chat):
    from langchain_core.exceptions import ContextOverflowError

    with pytest.raises(ContextOverflowError):
        chat.invoke(TOO_LONG[0]["content"])


def get_weather(city: str, unit: str) -> str:
    """The current weather in a city.

    Args:
        city: the city's name.
        unit: celsius or fahrenheit.
    """
    return f"Sunny in {city}"


def test_langchain_bind_tools(chat):
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    msg = bound.invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    # The schema langchain sends requires both and allows more (no additionalProperties).
    assert call["name"] == "get_weather" and {"city", "unit"} <= set(call["args"])
    assert isinstance(call["args"]["city"], str) and isinstance(call["args"]["unit"], str)


class City(BaseModel):
    """A city and its country."""

    city: str
    country: str


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat, method):
    city = chat.with_structured_output(City, method=method).invoke("Which city is the capital of France?")
    assert isinstance(city, City) and city.city and city.country


def test_litellm_structured_output(server, model_id):
    import litellm

    r = litellm.completion(model=f"openai/{model_id}", api_base=server.base_url, api_key=API_KEY, max_tokens=40,
                           num_retries=0, messages=[{"role": "user", "content": "Capital of France, as JSON."}],
                           response_format={"type": "json_schema", "json_schema": {
                               "name": "city", "schema": City.model_json_schema()}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) >= {"city", "country"}
