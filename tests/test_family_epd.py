"""EPD through real processes, beyond the conformance suite's per-family parity (tests/test_conformance.py): a
language server that loads no tower (--language-only) with two encoder workers answers the official `openai`
client and refuses bad media (images, audio) with a clear 4xx; an encoder that sends embeddings that do not fit
the model (another hidden size; a missing DeepStack level) ends only its own requests, with a clear error, while
concurrent requests complete with the right tokens."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from mmserve.testing.probes import settled_integrity
from mmserve.testing.server_process import free_port, start_encoder, start_server
from mmserve.testing.tiny_models import build_tiny_model
from tests.engine_helpers import image_case, reference_text, text_case
from tests.families import FAMILIES

MAX_NEW = 8
ARCHS = sorted(FAMILIES)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("family-epd-logs"))


def chat(url: str, case, timeout: float = 120) -> httpx.Response:
    body = {"messages": case.messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def server_args(arch: str, *extra: str) -> list[str]:
    kwargs = FAMILIES[arch].mm_kwargs
    return ["--kv-cache-mb", "16", *(["--mm-processor-kwargs", json.dumps(kwargs)] if kwargs else []), *extra]


# Every family's EPD parity (two encoder workers, inside the whole E/P/D pipeline) is in the conformance suite
# (tests/test_conformance.py), Qwen2-VL's other EPD paths in tests/test_epd_e2e.py. These checks are generic:
# one family per thing they touch (images with and without DeepStack, a hybrid's start-up line, audio).
EPD_ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen2_audio"]


@pytest.fixture(scope="module", params=EPD_ARCHS)
def epd(request, tiny_model, logs):
    """(arch, model dir, a language-only server with two encoder workers, round robin)."""
    arch = request.param
    model_dir = tiny_model(arch)
    server = start_server(
        model_dir,
        *server_args(arch, "--language-only", "--encoder-workers", "2", "--encoder-routing", "round_robin"),
        "--enable-anonymous-registration",  # loopback only: the tests list and register encoders
        log_dir=logs,
    )
    yield arch, model_dir, server
    assert server.stop() == 0


def test_the_official_openai_client_chats_with_an_image(epd):
    """As a new user would: the `openai` package against `mmserve serve`, an image in a user message."""
    import openai

    arch, model_dir, server = epd
    spec = FAMILIES[arch]
    case = spec.one(64, "What is in this picture?")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=case.messages, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].message.content == reference_text(model_dir, MAX_NEW, spec.mm_kwargs)(case)
    assert reply.usage.prompt_tokens > MAX_NEW and reply.usage.completion_tokens == MAX_NEW
    # the start-up line a user reads names the state budget beside the KV budget, for a hybrid model only
    ready = next(line for line in server.log().splitlines() if line.startswith("mmserve: engine ready"))
    assert ("state cache" in ready) == (arch in ("qwen3_5", "qwen3_5_moe")), ready


def test_bad_media_over_epd_gets_a_clear_4xx(epd):
    arch, _, server = epd
    for messages, status, fragment in FAMILIES[arch].bad():  # not retried elsewhere: the client's fault
        body = {"messages": messages, "max_tokens": 2}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == status and fragment in r.json()["error"]["message"], r.text
    assert settled_integrity(server.url)["status"] == "ok"


def run_mixed(url: str, good_and_bad: list, texts: list) -> tuple[list, list]:
    """Send media requests and text-only requests all at once; returns both lists of responses."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(good_and_bad) + len(texts)) as pool:
        media = [pool.submit(chat, url, c) for c in good_and_bad]
        plain = [pool.submit(chat, url, c) for c in texts]
        return [f.result(timeout=180) for f in media], [f.result(timeout=180) for f in plain]


def check_isolation(epd, foreign_url: str, first_seed: int, bad_words: list[str]) -> None:
    """With the foreign encoder registered beside the server's two workers (round robin), 9 image requests
    and 4 text requests at once: each image request either ends with a 502 `bad_embedding` naming the
    problem, or equals HF; at least one of each; every text request equals HF; the engine stays sound."""
    arch, model_dir, server = epd
    url = server.url
    expected = reference_text(model_dir, MAX_NEW, FAMILIES[arch].mm_kwargs)
    cases = [image_case([first_seed + i], f"Picture {i}.") for i in range(9)]
    texts = [text_case(f"Tell me about number {i}.") for i in range(4)]
    assert httpx.post(url + "/register_encoder", json={"url": foreign_url}, timeout=10).status_code == 200
    try:
        media, plain = run_mixed(url, cases, texts)
    finally:
        httpx.post(url + "/unregister_encoder", json={"url": foreign_url}, timeout=10)
    bad = [r for r in media if r.status_code != 200]
    assert bad and len(bad) < len(media), [r.status_code for r in media]
    for r in bad:
        error = r.json()["error"]
        assert r.status_code == 502 and error["code"] == "bad_embedding", r.text
        assert all(word in error["message"] for word in bad_words), error["message"]
    for case, r in zip(cases, media, strict=True):
        if r.status_code == 200:
            assert content(r) == expected(case)
    for case, r in zip(texts, plain, strict=True):
        assert content(r) == expected(case)
    assert settled_integrity(url)["status"] == "ok"


def test_encoder_of_another_model_fails_only_its_requests(epd, tmp_path, logs):
    """An encoder serving another checkpoint (the same patch settings, another hidden size) joins the pool:
    the engine refuses its embeddings at admission (before they could fail a whole batch), that request alone
    gets 502, and everything else is served right."""
    arch, _, _ = epd
    if arch != "qwen2_5_vl":
        pytest.skip("one family is enough: the check is generic")

    def narrower(config) -> None:
        text = config.text_config
        text.hidden_size, text.intermediate_size = 32, 48
        text.rope_parameters["mrope_section"] = [1, 1, 2]  # head_dim 8
        config.vision_config.hidden_size = 32  # the merger's output = the LM width

    other = build_tiny_model(str(tmp_path / "other"), "qwen2_vl", edit_config=narrower)
    bad = start_encoder(other, "--mm-processor-kwargs", json.dumps(FAMILIES[arch].mm_kwargs), log_dir=logs)
    try:
        check_isolation(epd, bad.url, 80, ["does not fit this model", "(rows, 64)", bad.url])
    finally:
        bad.stop()


class DeepStackDroppingEncoder:
    """An encoder service (the real encoder classes, in this process) whose parts lack one DeepStack level:
    what a buggy or mismatched encoder build would send."""

    def __init__(self, model_dir: str, drop: str = "deepstack.1") -> None:
        from mmserve.config import MediaConfig
        from mmserve.encoder.runner import build_encoder
        from mmserve.models.family import load_family
        from mmserve.transport.zmq_channel import EmbeddingSender

        family = load_family(model_dir, mm_processor_kwargs=FAMILIES["qwen3_vl"].mm_kwargs)
        self.encoder = build_encoder(family, "float32", "cpu", 64, MediaConfig())
        self.sender = EmbeddingSender(5.0)
        self.drop = drop
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def encode_job(self, job: dict) -> None:
        from mmserve.encoder.runner import MediaInput
        from mmserve.multimodal.items import ItemEmbedding, Modality
        from mmserve.multimodal.media import MediaRef
        from mmserve.transport.embedding_wire import EmbeddingItem, encode_part

        items = []
        for it in job["items"]:
            enc = self.encoder.encode(
                MediaInput(Modality(it["modality"]), MediaRef.parse(it["url"]), it["settings"])
            )
            tensors = {k: v for k, v in enc.tensors.items() if k != self.drop}
            items.append(
                EmbeddingItem(
                    it["item_index"], ItemEmbedding(enc.modality, enc.content_hash, tensors, enc.metadata)
                )
            )
        frames = encode_part(job["request_id"], job["part_index"], job["num_parts"], self.url, items)
        self.sender.send(job["reply_endpoint"], frames)

    def _handler(self):
        service = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # /health
                self._reply({"status": "ok", "cache": {}})

            def do_POST(self):  # /encode
                job = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.encode_job(job)
                self._reply({"items": len(job["items"]), "cache_hits": 0, "encoder": service.url})

            def log_message(self, *args) -> None:
                pass

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.sender.close()
        self.encoder.close()


def test_part_missing_a_deepstack_level_fails_only_its_request(epd):
    arch, model_dir, _ = epd
    if arch != "qwen3_vl":
        pytest.skip("DeepStack is Qwen3-VL's")
    fake = DeepStackDroppingEncoder(model_dir)
    try:
        check_isolation(epd, fake.url, 90, ["does not fit this model", "deepstack.1", fake.url])
    finally:
        fake.close()
