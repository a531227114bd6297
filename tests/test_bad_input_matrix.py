"""A matrix of bad (and borderline) inputs sent to a real server over HTTP.

Each case gets its documented 4xx with an OpenAI-style error body naming the problem, within 5 s, and the
server stays healthy. A few borderline inputs that the server deliberately accepts (a lying MIME type, an
animated GIF, a CMYK JPEG) are pinned at 200 so that a change of policy is noticed.

Network rule: traffic goes to loopback only. Private, link-local and metadata destinations are reached
through host names pinned with `--media-resolve` (refused before connecting), and literal private IPs are
checked in-process against a transport that fails the test if it is ever used.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from mmserve.config import MediaConfig
from mmserve.multimodal.errors import MediaForbiddenError
from mmserve.multimodal.media import MediaRef, load_media
from mmserve.testing import bad_media as bm
from mmserve.testing import media_host as mh
from mmserve.testing.server_process import start_server

ANSWER_WITHIN_S = 5.0
CONTEXT = 4096  # the tiny model's max_position_embeddings
MAX_PROMPT_TOKENS = 1000
MAX_MM_PIXELS = 20_000  # a small image (resized to ~56x56) passes; 256x256 does not
BODY_LIMIT_MB = 2
MEDIA_LIMIT_MB = 1
PINNED = {"evil.test": "10.1.2.3", "home.test": "192.168.1.5", "meta.test": "169.254.169.254",
          "ll.test": "169.254.10.10", "media.test": "127.0.0.1"}  # fmt: skip


# -- a loopback media host ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def media_host() -> Iterator[mh.MediaHost]:
    big = MEDIA_LIMIT_MB * 2**20 * 2
    with mh.MediaHost() as host:
        host.routes.update({
            "/ok.png": lambda h: mh.send(h, bm.image()),
            "/big-declared": lambda h: mh.send(h, b"x" * 1000, declared=big),
            "/big-chunked": lambda h: mh.send_chunked(h, big),
            "/slow": lambda h: mh.send_slowly(h, 3.0),  # well past the server's 1 s fetch timeout
            "/redirect-private": lambda h: mh.redirect(h, "http://evil.test/ok.png"),
            "/redirect-loopback": lambda h: mh.redirect(h, host.url("/ok.png", host="127.0.0.2")),
        })  # fmt: skip
        yield host


# -- the server under test ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Ctx:
    url: str  # the server under test
    media_port: int
    allowed_dir: str
    outside_file: str

    @property
    def dotdot_path(self) -> str:
        """The outside file, spelled as a path below the allowed dir that climbs out with `..`."""
        outside_dir = os.path.basename(os.path.dirname(self.outside_file))
        return f"{self.allowed_dir}/../{outside_dir}/secret.png"


@pytest.fixture(scope="module")
def ctx(tiny_qwen2_vl, tmp_path_factory, media_host) -> Iterator[Ctx]:
    allowed = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside") / "secret.png"
    outside.write_bytes(bm.image())
    (allowed / "ok.png").write_bytes(bm.image())
    (allowed / "sub").mkdir()
    os.symlink(outside, allowed / "link.png")
    handle = start_server(
        tiny_qwen2_vl, "--kv-cache-mb", "16", "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
        "--max-media-mb", str(MEDIA_LIMIT_MB), "--media-fetch-timeout-s", "1", "--max-request-body-mb",
        str(BODY_LIMIT_MB), "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--max-mm-pixels-per-prompt",
        str(MAX_MM_PIXELS), "--allowed-local-media-path", str(allowed), "--allowed-media-networks", "127.0.0.1/32",
        "--media-resolve", *(f"{h}={ip}" for h, ip in PINNED.items()),
        log_dir=str(tmp_path_factory.mktemp("logs")),
    )  # fmt: skip
    yield Ctx(handle.url, media_host.port, str(allowed), str(outside))
    assert handle.stop() == 0


# -- request builders --------------------------------------------------------------------------------
Body = dict[str, Any] | bytes
Builder = Callable[[Ctx], Body]


def chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def image_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def image_bytes(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    return image_url(bm.data_uri(data, mime))


def video_bytes(data: bytes, mime: str = "video/mp4") -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": bm.data_uri(data, mime)}}


def audio(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def hi(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def fetched(path: str, host: str = "127.0.0.1") -> Builder:
    return lambda c: chat(image_url(f"http://{host}:{c.media_port}{path}"))


def words(n: int) -> str:
    return " ".join(f"w{i % 97}" for i in range(n))  # each "wNN" is at least one token


@dataclass(frozen=True)
class Case:
    build: Builder
    status: int
    fragment: str  # must appear in error.message (ignored for 200)
    path: str = "/v1/chat/completions"
    method: str = "POST"


def const(body: Body) -> Builder:
    return lambda _: body


def _cases() -> dict[str, Case]:
    png, jpeg = bm.image(), bm.image(fmt="JPEG")
    comp = "/v1/completions"
    return {
        # malformed bodies and wrong types
        "json_truncated": Case(const(b'{"messages": [{"role": "user"'), 400, "not valid JSON"),
        "json_invalid_utf8": Case(const(b'{"messages": "\xff\xfe"}'), 400, "not valid JSON"),
        "json_array_body": Case(const(b"[1, 2]"), 400, "must be a JSON object"),
        "json_nan_temperature": Case(
            const(b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
            400,
            "temperature",
        ),
        "message_not_object": Case(const({"messages": [1]}), 400, "messages.0"),
        "role_not_string": Case(const({"messages": [{"role": 7, "content": "hi"}]}), 400, "role"),
        "content_number": Case(const({"messages": [{"role": "user", "content": 42}]}), 400, "content"),
        "max_tokens_string": Case(const(hi(max_tokens="ten")), 400, "max_tokens"),
        "max_tokens_fraction": Case(const(hi(max_tokens=2.5)), 400, "max_tokens"),
        "temperature_string": Case(const(hi(temperature="hot")), 400, "temperature"),
        "stream_list": Case(const(hi(stream=[1])), 400, "stream"),
        "stop_number": Case(const(hi(stop=5)), 400, "stop"),
        "n_too_many": Case(const(hi(n=17)), 400, "n"),
        "n_float": Case(const(hi(n=2.5)), 400, "n"),
        "penalty_out_of_range": Case(const(hi(presence_penalty=2.5)), 400, "presence_penalty"),
        "logit_bias_not_a_token": Case(const(hi(logit_bias={"five": 1})), 400, "logit_bias"),
        "top_logprobs_without_logprobs": Case(const(hi(top_logprobs=2)), 400, "top_logprobs"),
        "malformed_json_schema": Case(
            const(
                hi(
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": 1}},
                    }
                )
            ),
            400,
            "response_format.json_schema.schema",
        ),
        "unknown_response_format": Case(const(hi(response_format={"type": "yaml"})), 400, "response_format"),
        "unknown_tool": Case(
            const(
                hi(
                    tools=[{"type": "function", "function": {"name": "f"}}],
                    tool_choice={"type": "function", "function": {"name": "g"}},
                )
            ),
            400,
            "unknown tool",
        ),
        # fields this server does not implement are refused by name, never accepted and ignored
        "unimplemented_best_of": Case(const(hi(best_of=2)), 400, "best_of: not supported"),
        "unimplemented_audio_output": Case(
            const(hi(audio={"voice": "alloy", "format": "wav"})), 400, "audio: not supported"
        ),
        "unimplemented_stream_option": Case(
            const(hi(stream=True, stream_options={"include_obfuscation": True})),
            400,
            "stream_options.include_obfuscation: not supported",
        ),
        "stream_options_without_stream": Case(
            const(hi(stream_options={"include_usage": True})), 400, "stream_options: only allowed when stream"
        ),
        "output_modality_audio": Case(const(hi(modalities=["text", "audio"])), 400, "modalities"),
        "template_kwargs_reserved": Case(
            const(hi(chat_template_kwargs={"tools": []})), 400, "chat_template_kwargs: tools"
        ),
        "prefill_and_generation_prompt": Case(
            const(hi(continue_final_message=True)), 400, "continue_final_message"
        ),
        "unimplemented_completion_field": Case(
            const({"prompt": "hi", "max_tokens": 2, "suffix": "!"}),
            400,
            "suffix: not supported",
            path="/v1/completions",
        ),
        "misplaced_message_key": Case(
            const({"messages": [{"role": "user", "content": "hi", "tool_calls": []}], "max_tokens": 2}),
            400,
            "'tool_calls' belongs to an assistant message",
        ),
        "unknown_image_detail": Case(
            const(
                chat({"type": "image_url", "image_url": {"url": bm.data_uri(bm.image()), "detail": "ultra"}})
            ),
            400,
            "detail must be one of",
        ),
        "ignored_fields_control": Case(
            const(
                hi(
                    user="u-1",
                    metadata={"k": "v"},
                    store=False,
                    service_tier="auto",
                    prediction={"type": "content", "content": "x"},
                )
            ),
            200,
            "",
        ),
        "text_part_not_string": Case(
            const(chat({"type": "text", "text": 7})), 400, "'text' must be a string"
        ),
        "image_url_missing_url": Case(
            const(chat({"type": "image_url", "image_url": {}})), 400, "'image_url'"
        ),
        "part_not_object": Case(const(chat("just a string")), 400, "content[1]"),  # type: ignore[arg-type]
        "part_type_input_file": Case(const(chat({"type": "input_file", "file": {}})), 400, "'input_file'"),
        "input_audio_no_data": Case(
            const(chat({"type": "input_audio", "input_audio": {}})), 400, "input_audio"
        ),
        "unknown_route": Case(const(hi()), 404, "Not Found", "/v1/chat/complete"),
        "wrong_method": Case(const(b""), 405, "Method Not Allowed", method="GET"),
        "lone_surrogate_in_chat_text": Case(
            const(hi(messages=[{"role": "user", "content": "a\ud800"}])), 400, "surrogate"
        ),
        "lone_surrogate_in_completion": Case(
            const({"prompt": "\udfff", "max_tokens": 2}), 400, "surrogate", comp
        ),
        "media_scheme_ftp": Case(const(chat(image_url("ftp://127.0.0.1/x.png"))), 400, "'ftp'"),
        # sampling parameters out of range
        "max_tokens_negative": Case(const(hi(max_tokens=-5)), 400, "max_tokens"),
        "max_tokens_equals_context": Case(const(hi(max_tokens=CONTEXT)), 400, "context length"),
        "max_tokens_huge_int": Case(const(hi(max_tokens=10**30)), 400, "max_tokens"),
        "max_completion_tokens_zero": Case(const(hi(max_completion_tokens=0)), 400, "max_completion_tokens"),
        "temperature_negative": Case(const(hi(temperature=-0.1)), 400, "temperature"),
        "top_p_above_one": Case(const(hi(top_p=1.5)), 400, "top_p"),
        "top_k_below_minus_one": Case(const(hi(top_k=-2)), 400, "top_k"),
        "min_p_above_one": Case(const(hi(min_p=2)), 400, "min_p"),
        # integers past int64 used to reach the engine (top_k=2**63 killed it; a huge seed was a 500)
        "top_k_past_int64": Case(const(hi(top_k=2**63)), 400, "top_k"),
        "seed_past_uint64": Case(const(hi(seed=2**64)), 400, "seed"),
        "stop_token_id_past_int64": Case(const(hi(stop_token_ids=[2**64])), 400, "stop_token_ids"),
        # a temperature that underflows float32 used to crash sampling (0 / 0); it samples greedily now
        "temperature_underflows_float32": Case(const(hi(temperature=1e-320)), 200, ""),
        # /v1/completions
        "completion_empty_prompt": Case(const({"prompt": ""}), 400, "prompt", comp),
        "completion_token_out_of_vocab": Case(const({"prompt": [10**9]}), 400, "token id", comp),
        "completion_batch_token_out_of_vocab": Case(
            const({"prompt": [[1, 2], [3, 10**9]]}), 400, "prompt[1]: token id", comp
        ),
        "completion_batch_empty_prompt": Case(const({"prompt": ["a", ""]}), 400, "non-empty", comp),
        "completion_batch_mixed": Case(const({"prompt": ["a", [1, 2]]}), 400, "prompt", comp),
        "completion_max_tokens_zero": Case(const({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens", comp),
        "completion_echo_not_bool": Case(const({"prompt": "hi", "echo": [1]}), 400, "echo", comp),
        "completion_logprobs_over_limit": Case(
            const({"prompt": "hi", "logprobs": 21}), 400, "logprobs", comp
        ),
        "completion_unknown_model": Case(const({"prompt": "hi", "model": "gpt-x"}), 404, "gpt-x", comp),
        # lengths and per-request limits
        "prompt_over_context": Case(
            lambda _: hi(messages=[{"role": "user", "content": words(CONTEXT)}]), 400, "context"
        ),
        "prompt_over_max_prompt_tokens": Case(
            lambda _: hi(messages=[{"role": "user", "content": words(MAX_PROMPT_TOKENS + 200)}]),
            400,
            "--max-prompt-tokens",
        ),
        "media_over_max_mm_pixels": Case(
            const(chat(image_bytes(bm.flat_image(256, 256)))), 413, "--max-mm-pixels-per-prompt"
        ),
        "too_many_images": Case(const(chat(*[image_bytes(png)] * 3)), 400, "at most 2"),
        "too_many_videos": Case(const(chat(*[video_bytes(b"x")] * 2)), 400, "at most 1"),
        "body_over_limit_by_length": Case(const(b" " * (BODY_LIMIT_MB * 2**20 + 1)), 413, "body"),
        # data URIs and what they carry
        "base64_bad_padding": Case(const(chat(image_url("data:image/png;base64,abc"))), 400, "base64"),
        "data_uri_no_comma": Case(const(chat(image_url("data:image/png;base64"))), 400, "malformed data URI"),
        "png_mime_jpeg_bytes": Case(const(chat(image_bytes(jpeg, "image/png"))), 200, ""),
        "png_mime_wav_bytes": Case(const(chat(image_bytes(bm.wav(), "image/png"))), 400, "not an image"),
        "png_mime_text_bytes": Case(
            const(chat(image_bytes(b"hello, world", "image/png"))), 400, "not an image"
        ),
        "image_garbage_bytes": Case(const(chat(image_bytes(bm.garbage()))), 400, "image #1"),
        "image_truncated_png": Case(const(chat(image_bytes(bm.truncated(png)))), 400, "image #1"),
        "image_truncated_jpeg": Case(
            const(chat(image_bytes(bm.truncated(jpeg), "image/jpeg"))), 400, "image #1"
        ),
        "image_png_bomb_30000x30000": Case(const(chat(image_bytes(bm.png_bomb()))), 413, "pixels"),
        "image_png_bomb_5000x5000": Case(
            const(chat(image_bytes(bm.png_bomb(5000, 5000)))), 413, "more than the limit"
        ),
        "image_1x100000": Case(const(chat(image_bytes(bm.flat_image(1, 100_000)))), 400, "aspect ratio"),
        "image_animated_gif": Case(const(chat(image_bytes(bm.animated_gif(), "image/gif"))), 200, ""),
        "image_cmyk_jpeg": Case(const(chat(image_bytes(bm.image(fmt="JPEG", mode="CMYK")))), 200, ""),
        "image_error_while_streaming": Case(
            const(chat(image_bytes(bm.garbage()), stream=True)), 400, "image #1"
        ),
        "video_text_bytes": Case(const(chat(video_bytes(b"not a video at all"))), 400, "video #1"),
        "video_garbage_bytes": Case(const(chat(video_bytes(bm.garbage(4096)))), 400, "video #1"),
        "video_no_frames": Case(
            const(chat(video_bytes(bm.video_without_frames(), "video/avi"))), 400, "no frames"
        ),
        "video_claims_10_hours": Case(const(chat(video_bytes(bm.video_claiming_hours()))), 413, "36001"),
        "audio_wav_u8": Case(const(chat(audio(bm.wav(subtype="PCM_U8")))), 400, "takes no audio input"),
        "audio_wav_float64": Case(const(chat(audio(bm.wav(subtype="DOUBLE")))), 400, "takes no audio input"),
        "audio_garbage_bytes": Case(const(chat(audio(bm.garbage()))), 400, "takes no audio input"),
        # http(s) fetches: the SSRF guard (only 127.0.0.1 is allowed, by --allowed-media-networks)
        "url_ok_control": Case(fetched("/ok.png"), 200, ""),
        "url_pinned_host_ok_control": Case(fetched("/ok.png", host="media.test"), 200, ""),
        "url_loopback_not_allowed": Case(fetched("/ok.png", host="127.0.0.2"), 400, "loopback"),
        "url_ipv6_loopback": Case(fetched("/ok.png", host="[::1]"), 400, "loopback"),
        "url_ipv4_mapped_ipv6": Case(fetched("/ok.png", host="[::ffff:127.0.0.1]"), 400, "tunnelled in IPv6"),
        "url_host_resolves_private_10": Case(
            fetched("/x", host="evil.test"), 400, "private address 10.1.2.3"
        ),
        "url_host_resolves_private_192": Case(
            fetched("/x", host="home.test"), 400, "private address 192.168"
        ),
        "url_host_resolves_metadata": Case(fetched("/x", host="meta.test"), 400, "cloud metadata"),
        "url_host_resolves_link_local": Case(fetched("/x", host="ll.test"), 400, "link-local"),
        "url_redirect_to_private": Case(fetched("/redirect-private"), 400, "evil.test"),
        "url_redirect_to_other_loopback": Case(fetched("/redirect-loopback"), 400, "127.0.0.2"),
        "url_http_404": Case(fetched("/missing.png"), 400, "HTTP 404"),
        "url_too_large_by_content_length": Case(fetched("/big-declared"), 413, "limit"),
        "url_too_large_chunked": Case(fetched("/big-chunked"), 413, "limit"),
        "url_slow_past_fetch_timeout": Case(fetched("/slow"), 400, "timed out"),
        # file://
        "file_ok_control": Case(lambda c: chat(image_url(f"file://{c.allowed_dir}/ok.png")), 200, ""),
        "file_outside_allowed_dir": Case(
            lambda c: chat(image_url(f"file://{c.outside_file}")), 400, "outside"
        ),
        "file_dotdot_escape": Case(lambda c: chat(image_url(f"file://{c.dotdot_path}")), 400, "outside"),
        "file_symlink_escape": Case(
            lambda c: chat(image_url(f"file://{c.allowed_dir}/link.png")), 400, "outside"
        ),
        "file_missing": Case(
            lambda c: chat(image_url(f"file://{c.allowed_dir}/nope.png")), 400, "cannot open"
        ),
        "file_directory": Case(
            lambda c: chat(image_url(f"file://{c.allowed_dir}/sub")), 400, "not a regular file"
        ),
        "file_remote_host": Case(const(chat(image_url("file://example.com/ok.png"))), 400, "remote host"),
    }


CASES = _cases()


def send(c: Ctx, case: Case) -> httpx.Response:
    body = case.build(c)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.request(case.method, c.url + case.path, content=content, headers=headers,
                         timeout=ANSWER_WITHIN_S + 5)  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_a_clear_4xx_fast_and_server_stays_healthy(ctx: Ctx, name: str) -> None:
    case = CASES[name]
    start = time.monotonic()
    r = send(ctx, case)
    elapsed = time.monotonic() - start
    assert r.status_code == case.status, r.text[:500]
    assert elapsed < ANSWER_WITHIN_S, f"answered in {elapsed:.1f} s"
    if case.status == 200:
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    else:
        err = r.json()["error"]
        assert case.fragment in err["message"], err
        assert err["type"] and err["code"], err
    assert httpx.get(ctx.url + "/health", timeout=5).status_code == 200


def test_body_over_limit_streamed_without_content_length(ctx: Ctx) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"messages": "'
        for _ in range(BODY_LIMIT_MB * 16 + 1):  # 64 KiB each, one past the limit
            yield b"x" * 65536

    start = time.monotonic()
    r = httpx.post(ctx.url + "/v1/chat/completions", content=chunks(), timeout=ANSWER_WITHIN_S + 5)
    assert time.monotonic() - start < ANSWER_WITHIN_S
    assert r.status_code == 413 and "body" in r.json()["error"]["message"], r.text[:300]
    assert httpx.get(ctx.url + "/health", timeout=5).status_code == 200


def test_a_slow_download_does_not_hold_up_other_requests(ctx: Ctx) -> None:
    """Media of different requests are fetched in parallel: a request with an inline image is answered
    while another waits on a slow server (which ends in a 400 after the 1 s fetch timeout)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        # Three slow fetches: one at a time they would take 3 s; in parallel they all end after ~1 s.
        slow = [pool.submit(send, ctx, CASES["url_slow_past_fetch_timeout"]) for _ in range(3)]
        time.sleep(0.2)  # both slow fetches have started
        fast = send(ctx, Case(lambda c: chat(image_bytes(bm.image(seed=7))), 200, ""))
        assert fast.status_code == 200, fast.text[:300]
        assert not all(f.done() for f in slow), "the inline image waited for the slow downloads"
        assert all(f.result(timeout=10).status_code == 400 for f in slow)


# -- literal private IPs: refused in-process before any connection -----------------------------------
def _never_called(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"the fetcher connected to {request.url}")


def _no_dns(host: str, port: int) -> list[str]:
    raise AssertionError(f"the fetcher resolved {host}")


@pytest.mark.parametrize(
    "url,reason",
    [("http://10.1.2.3/x.png", "private"), ("http://192.168.0.1/x.png", "private"),
     ("http://172.16.5.4/x.png", "private"), ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
     ("http://169.254.10.10/x.png", "link-local"), ("http://127.0.0.1/x.png", "loopback"),
     ("http://[::1]/x.png", "loopback"), ("http://[::ffff:10.0.0.1]/x.png", "private (tunnelled in IPv6)"),
     ("http://[fd00:ec2::254]/", "cloud metadata"), ("http://[fe80::1]/x.png", "link-local"),
     ("http://0.0.0.0/x.png", "unspecified"), ("http://100.64.0.1/x.png", "non-global")],
)  # fmt: skip
def test_literal_private_ips_are_refused_before_connecting(url: str, reason: str) -> None:
    cfg = MediaConfig(fetch_timeout_s=1.0)
    with pytest.raises(MediaForbiddenError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        load_media(MediaRef.parse(url), cfg, resolver=_no_dns, transport=httpx.MockTransport(_never_called))


def test_the_matrix_is_at_least_40_cases() -> None:
    assert len(CASES) >= 40
