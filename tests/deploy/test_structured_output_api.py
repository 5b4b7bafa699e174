"""`response_format` over HTTP: JSON schemas, the regex extension, and 400 for a bad schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from test_serve import server  # noqa: F401  (the module's Serve app fixture)

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"enum": ["Paris", "Lima", "Oslo"]},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 9}}}


def test_response_format_over_http(server):  # noqa: F811
    url, model_dir, *_ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-")
    name = Path(model_dir).name
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.0):
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "A city?"}], max_tokens=40,
            temperature=temperature, seed=4, response_format=fmt)
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    stream = client.completions.create(model=name, prompt="x", max_tokens=40, temperature=1.0,
                                       seed=5, stream=True, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream if c.choices)), SCHEMA)
    date = client.completions.create(
        model=name, prompt="Today:", max_tokens=20, temperature=1.0, seed=6,
        extra_body={"response_format": {"type": "regex", "regex": r"\d{4}-\d{2}-\d{2}"}})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.choices[0].text)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "invalid json schema"),
    ({"type": "regex"}, "needs a `regex` field"),
    ({"type": "yaml"}, "response_format"),
])
def test_a_bad_response_format_is_a_400(server, fmt, words):  # noqa: F811
    url, model_dir, *_ = server
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "response_format": fmt})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
