"""vLLM's extra endpoints over real HTTP: /tokenize, /detokenize, /version, /ping, /v1/models/{id}, model aliases,
and which of them need the API key (the tiny model's servers shared with other modules, tests/conftest.py: the
plain one, served as "tiny" and "tiny-alias", and the one with an API key)."""

from __future__ import annotations

import json

import httpx
import pytest

from mmserve.models.loader import load_tokenizer
from tests.conftest import API_KEY
from tests.engine_helpers import image_case

AUTH = {"Authorization": f"Bearer {API_KEY}"}  # the keyed server's; the plain one takes any
TEXT_MESSAGES = [{"role": "user", "content": "Describe what you see."}]


@pytest.fixture(scope="module")
def server(shared_server):
    """The plain server (no API key), served as "tiny" and "tiny-alias"."""
    return shared_server


@pytest.fixture(scope="module")
def keyed(shared_keyed_process):
    """The server with --api-key."""
    return shared_keyed_process.get()


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_vl):
    return load_tokenizer(tiny_qwen2_vl)


def post(server, path: str, body, headers=AUTH) -> httpx.Response:
    # json.dumps escapes non-ASCII (httpx's json= would fail on a lone surrogate before sending it)
    content = json.dumps(body).encode()
    headers = {**(headers or {}), "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    return error["message"]


def test_tokenize_a_prompt_and_detokenize_it_back(server, tokenizer):
    r = post(server, "/tokenize", {"prompt": "Hello world, again", "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == tokenizer("Hello world, again")["input_ids"]
    assert out["count"] == len(out["tokens"]) > 0
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    models = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()
    assert out["max_model_len"] == models["data"][0]["max_model_len"]
    assert "token_strs" not in post(server, "/tokenize", {"prompt": "x"}).json()  # only when asked
    back = post(server, "/detokenize", {"tokens": out["tokens"], "model": "tiny"})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world, again"}


def test_chat_tokenize_counts_what_a_completion_reports(server):
    def prompt_tokens(messages) -> int:
        body = {"model": "tiny", "messages": messages, "max_tokens": 1}
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    text = post(server, "/tokenize", {"messages": TEXT_MESSAGES}).json()
    assert text["count"] == len(text["tokens"]) == prompt_tokens(TEXT_MESSAGES)
    without = post(server, "/tokenize", {"messages": TEXT_MESSAGES, "add_generation_prompt": False}).json()
    assert without["count"] < text["count"]  # the assistant header is not there

    images = image_case([1, 2], "Describe what you see.").messages
    counted = post(server, "/tokenize", {"messages": images})
    assert counted.status_code == 200, counted.text
    count = counted.json()["count"]
    assert count > text["count"] + 2  # each image is many tokens, not one placeholder
    assert count == prompt_tokens(images)


def test_version_ping_and_health_need_no_key(keyed):
    version = httpx.get(keyed.url + "/version", timeout=10)
    assert version.status_code == 200 and version.json()["version"]
    assert httpx.get(keyed.url + "/ping", timeout=10).status_code == 200
    assert httpx.post(keyed.url + "/ping", timeout=10).status_code == 200
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200


def test_tokenizer_endpoints_need_the_key(keyed):
    assert post(keyed, "/tokenize", {"prompt": "hi"}, headers=None).status_code == 401
    assert (
        post(keyed, "/detokenize", {"tokens": [1]}, headers={"Authorization": "Bearer no"}).status_code == 401
    )
    assert httpx.get(keyed.url + "/v1/models/tiny", timeout=10).status_code == 401
    # and with the key they answer
    assert post(keyed, "/tokenize", {"prompt": "hi"}).status_code == 200
    assert post(keyed, "/detokenize", {"tokens": [1]}).status_code == 200
    assert httpx.get(keyed.url + "/v1/models/tiny", headers=AUTH, timeout=10).status_code == 200


def test_models_list_every_served_name_and_aliases_are_served(server):
    listed = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in listed["data"]] == ["tiny", "tiny-alias"]
    one = httpx.get(server.url + "/v1/models/tiny-alias", headers=AUTH, timeout=10)
    assert one.status_code == 200 and one.json()["id"] == "tiny-alias" and one.json()["object"] == "model"
    missing = httpx.get(server.url + "/v1/models/other", headers=AUTH, timeout=10)
    assert "other" in error_of(missing, 404) and missing.json()["error"]["code"] == "model_not_found"
    body = {"model": "tiny-alias", "messages": TEXT_MESSAGES, "max_tokens": 1}
    answer = post(server, "/v1/chat/completions", body)
    assert answer.status_code == 200 and answer.json()["model"] == "tiny"  # the primary name, as vLLM
    assert post(server, "/tokenize", {"model": "tiny-alias", "prompt": "hi"}).status_code == 200
    assert "other" in error_of(post(server, "/tokenize", {"model": "other", "prompt": "hi"}), 404)


@pytest.mark.parametrize(
    "path,body,fragment",
    [
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "hi", "temperature": 1}, "temperature: not supported"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "\ud800"}, "surrogate"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": ["wizard"], "content": "x"}]}, "role"),
        ("/tokenize", {"messages": TEXT_MESSAGES, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", [1, 2], "JSON object"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, fragment):
    assert fragment in error_of(post(server, path, body), 400)


def test_media_that_cannot_be_read_is_a_400_naming_the_item(server):
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    messages = [{"role": "user", "content": [bad, {"type": "text", "text": "hi"}]}]
    assert "image #1" in error_of(post(server, "/tokenize", {"messages": messages}), 400)


def test_non_json_body_is_a_400(server):
    r = httpx.post(server.url + "/tokenize", content=b"{not json", headers=AUTH, timeout=10)
    assert "JSON" in error_of(r, 400)
