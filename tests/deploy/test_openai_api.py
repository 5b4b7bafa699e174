"""The OpenAI wire format and chat templates, without a server: parsing, prompts, bodies."""

from __future__ import annotations

import json
import shutil

import pytest

from metrale.cluster.params import RequestError
from metrale.cluster.sequence import TokenLogprob
from metrale.cluster.stream import Delta
from metrale.deploy.chat import ChatTemplate
from metrale.deploy.llm import load_tokenizer
from metrale.deploy.openai_api import (ChatCompletionRequest, CompletionRequest, ResponseBuilder,
                                       parse)
from metrale.drafting.stats import SpecStats

QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint("qwen3"))


def test_prompts_in_every_form(tokenizer):
    ids = tokenizer.encode("The café").ids
    x = tokenizer.encode("x").ids
    for prompt, expected in [("The café", [ids]), (["The café", "x"], [ids, x]), (ids, [ids]),
                             ([ids, [3]], [ids, [3]])]:
        req = parse(CompletionRequest, json.dumps({"prompt": prompt}).encode())
        assert req.prompts(tokenizer) == expected
    assert req.max_tokens == 16 and not req.stream
    with pytest.raises(RequestError, match="prompt must not be empty"):
        parse(CompletionRequest, b'{"prompt": []}').prompts(tokenizer)


@pytest.mark.parametrize("body, words", [
    (b'{"prompt": "x"', "not valid JSON"),
    (b'{"prompt": "x", "temperature": "0.5"}', "temperature"),
    (b'{"prompt": "x", "n": 1.5}', "n:"),
    (b'{"prompt": {"text": "x"}}', "prompt"),
    (b'{"max_tokens": 3}', "prompt: Field required"),
])
def test_parse_errors_name_the_field(body, words):
    with pytest.raises(RequestError, match=words):
        parse(CompletionRequest, body)


def test_sampling_params_from_a_request():
    req = parse(CompletionRequest, json.dumps({
        "prompt": "x", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
        "min_p": 0.1, "seed": 3, "stop": "\n", "n": 2, "ignore_eos": True, "logprobs": 1,
        "user": "ignored"}).encode())
    p = req.sampling_params(req.max_tokens, req.logprobs)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop, p.n,
            p.ignore_eos, p.logprobs) == (5, 0.5, 0.9, 7, 0.1, 3, ("\n",), 2, True, 1)
    with pytest.raises(RequestError, match="top_p"):
        req.model_copy(update={"top_p": 2.0}).sampling_params(5, None)


def test_chat_templates(checkpoint, tmp_path):
    messages = parse(ChatCompletionRequest, json.dumps({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "you"}]},
    ]}).encode()).messages
    plain = [m.plain() for m in messages]
    assert ChatTemplate(None).render(plain) == "system: Be brief.\nuser: Hi you\nassistant:"
    model_dir = shutil.copytree(checkpoint("qwen3"), tmp_path / "m")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_LIKE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.for_checkpoint(model_dir)
    assert not template.is_plain
    assert template.render(plain) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                      "Hi you<|im_end|>\n<|im_start|>assistant\n")
    (model_dir / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}")
    with pytest.raises(RequestError, match="user first"):
        ChatTemplate.for_checkpoint(model_dir).render(plain)


def test_response_bodies(tokenizer):
    builder = ResponseBuilder(True, "m", tokenizer, 2, prompt_tokens=5, logprobs=True)
    a, b = tokenizer.encode("ab").ids[:1], tokenizer.encode("c").ids[:1]
    builder.add(1, Delta("r", 1, "c", b, [TokenLogprob(b[0], -0.5, [(b[0], -0.5)])], "stop",
                         SpecStats(1, 3, 2)))
    builder.add(0, Delta("r", 0, "a", a, [TokenLogprob(a[0], -0.1, [])], "length",
                         SpecStats(2, 4, 0)))
    body = builder.response()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["message"]["content"] for c in body["choices"]] == ["a", "c"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["choices"][1]["logprobs"]["content"][0]["top_logprobs"][0]["logprob"] == -0.5
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert body["speculation"] == {"rounds": 3, "drafts_proposed": 7, "drafts_accepted": 2,
                                   "mean_acceptance_length": 1.6667}
    first = builder.chunk(0, Delta("r", 0, "a"), first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    completion = ResponseBuilder(False, "m", tokenizer, 1, 1, logprobs=True)
    completion.add(0, Delta("r", 0, "a", a, [TokenLogprob(a[0], -0.1, [(a[0], -0.1)])], "stop"))
    lp = completion.response()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.1] and lp["tokens"] == [tokenizer.decode(a)]
