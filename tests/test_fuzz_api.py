"""Schema-driven fuzzing of the real server: whatever schemathesis sends, nothing answers 5xx.

The request schemas come from the server's own /openapi.json (the pydantic models of `protocol.py`). Runs are
bounded and reproducible: a fixed number of examples per operation, `derandomize=True`, no example database.
The server runs with a 64-token context so that no generated request can cause a long generation.
"""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from mmserve.testing import bad_media as bm
from mmserve.testing.server_process import start_server
from mmserve.transport.cluster_auth import ENV_VAR

# Examples per (operation, mode); the two generation endpoints get most of the budget.
EXAMPLES = {"POST /v1/chat/completions": 60, "POST /v1/completions": 40}
DEFAULT_EXAMPLES = 5
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
                print_blob=True)  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    # A cluster secret: fuzzed registrations are refused (401), so the server never probes a generated URL.
    handle = start_server(tiny_qwen2_vl, "--kv-cache-mb", "16", "--max-model-len", "64", "--max-request-body-mb", "1",
                          log_dir=str(tmp_path_factory.mktemp("logs")),
                          env={ENV_VAR: "fuzzing-only-cluster-secret"})  # fmt: skip
    yield handle
    assert handle.stop() == 0


@pytest.fixture(scope="module")
def schema(server):
    loaded = schemathesis.openapi.from_url(server.url + "/openapi.json", timeout=10)
    loaded.validate()  # a valid OpenAPI document, or schemathesis raises
    return loaded


def test_openapi_documents_the_request_bodies(server, schema) -> None:
    doc = requests.get(server.url + "/openapi.json", timeout=10).json()
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    components = doc["components"]["schemas"]
    assert {"messages", "max_tokens", "temperature"} <= set(components["ChatCompletionRequest"]["properties"])
    assert "StreamOptions" in components  # a nested model's $defs were merged, so its $ref resolves


# The schema types `messages` as a list of free-form objects, so schemathesis alone almost never builds a
# conversation the server accepts. Half the chat examples get one from here instead: well-formed in shape,
# with fuzzed text (lone surrogates and special tokens included), roles, part types and media references.
FRAGMENTS = st.sampled_from(
    ["\ud800", "\udfff", "\x00", "<|image_pad|>", "<|im_end|>", "\u202e", "\U0001f600"]
)
TEXT = st.lists(st.characters(exclude_categories=()) | FRAGMENTS, max_size=8).map("".join)
MEDIA_URLS = st.sampled_from([bm.data_uri(bm.image(16, 16)), bm.data_uri(b"not an image"), "data:image/png;base64,@",
                              "data:,", "http://127.0.0.1:1/x.png", "file:///etc/passwd", "gopher://x"])  # fmt: skip
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": MEDIA_URLS})}
    ),
    st.fixed_dictionaries({"type": st.just("video_url"), "video_url": MEDIA_URLS}),
    st.fixed_dictionaries(
        {"type": st.just("input_audio"), "input_audio": st.fixed_dictionaries({"data": TEXT})}
    ),
    st.fixed_dictionaries({"type": TEXT}),
)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]),
                                 "content": st.one_of(TEXT, st.lists(PART, max_size=3), st.none())})  # fmt: skip
CONVERSATION = st.none() | st.lists(MESSAGE, min_size=1, max_size=3)


def check_response(response: requests.Response) -> None:
    where = f"{response.request.method} {response.request.url} body={str(response.request.body)[:300]!r}"
    assert response.status_code < 500, f"{where} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        err = response.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"] and err["code"], (
            where,
            err,
        )


POS, NEG = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# Negative mode needs something to break (a body or a parameter); the others are fuzzed positively only.
RUNS = [(label, mode) for label in EXAMPLES for mode in (POS, NEG)] + [
    ("GET /health", POS), ("GET /health", NEG), ("GET /v1/models", POS), ("GET /encoders", POS),
    ("POST /register_encoder", POS),
]  # fmt: skip


@pytest.mark.parametrize("label,mode", RUNS, ids=[f"{label} {mode.value}" for label, mode in RUNS])
def test_fuzzed_requests_never_get_5xx(server, schema, label: str, mode: GenerationMode) -> None:
    method, path = label.split(" ")
    operation = schema[path][method]

    @settings(FUZZ, max_examples=EXAMPLES.get(label, DEFAULT_EXAMPLES))
    @given(case=operation.as_strategy(generation_mode=mode), conversation=CONVERSATION)
    def fuzz(case, conversation) -> None:
        if path == "/v1/chat/completions" and conversation is not None and isinstance(case.body, dict):
            case.body["messages"] = conversation
        check_response(case.call(base_url=server.url, timeout=10))

    fuzz()
    assert requests.get(server.url + "/health", timeout=5).status_code == 200
