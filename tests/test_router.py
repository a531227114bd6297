"""`mmserve router` against stand-in prefill and decode servers (mmserve.testing.pd_standin: the servers' HTTP
contract without a model). No model is loaded. The P/D pipeline launcher: tests/test_pipeline_launcher.py."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve.config import RouterConfig
from mmserve.disagg.router import build_router_app
from mmserve.disagg.router_registry import ServerInfo, ServerRegistry, affinity_key
from mmserve.testing.pd_standin import Behaviour, ServerThread, Standin, sse_chunks
from mmserve.transport.cluster_auth import ClusterSecret

SECRET = "router-test-secret-0123456789"
TOKEN = ClusterSecret(SECRET.encode()).headers


def chat(text: str, image: str | None = None, stream: bool = False) -> dict:
    content: list[dict] = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    return {"model": "standin-model", "messages": [{"role": "user", "content": content}], "stream": stream}


def route_of(resp: httpx.Response) -> dict[str, str]:
    return dict(part.split("=", 1) for part in resp.headers["x-mmserve-route"].split("; "))


def eventually(check: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def metric(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of `name` whose labels include `labels`, in Prometheus text; None if none."""
    families = text_string_to_metric_families(text)
    values = [
        s.value for f in families for s in f.samples if s.name == name and labels.items() <= s.labels.items()
    ]
    return sum(values) if values else None


class Cluster:
    def __init__(self) -> None:
        self.thread = ServerThread()
        self.prefill = [self.thread.serve_standin(Standin("prefill", SECRET)) for _ in range(3)]
        self.decode = [self.thread.serve_standin(Standin("decode", SECRET)) for _ in range(3)]
        self.url, _ = self.router(health_interval_s=0.2)
        self.http = httpx.Client(timeout=10, trust_env=False)

    def router(self, static: bool = True, **fields) -> tuple[str, object]:
        fields.setdefault("cluster_secret", SECRET)
        if static:
            fields["prefill_urls"] = tuple(s.url for s in self.prefill)
            fields["decode_urls"] = tuple(s.url for s in self.decode)
        port, server = self.thread.serve(build_router_app(RouterConfig(**fields)))
        return f"http://127.0.0.1:{port}", server

    def by_url(self, url: str) -> Standin:
        return next(s for s in self.prefill + self.decode if s.url == url)

    def servers(self, url: str | None = None) -> dict[str, dict]:
        resp = self.http.get(f"{url or self.url}/servers", headers=TOKEN)
        return {s["url"]: s for s in resp.json()["servers"]}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.http.close()
    c.thread.close()


@pytest.fixture
def pd(cluster):
    for s in cluster.prefill + cluster.decode:
        s.behaviour, s.requests[:], s.aborted[:] = Behaviour(), [], []
    assert eventually(lambda: all(s["healthy"] for s in cluster.servers().values()))
    return cluster


# -- policy (no HTTP) -------------------------------------------------------------------------------
def test_affinity_key_is_the_prompt_prefix():
    def key(body: dict, kind: str = "chat") -> bytes:
        return affinity_key(kind, body, text_chars=512, token_ids=256)

    long = "x" * 600
    assert key(chat("what is it?", "http://img/a.png")) == key(chat("and its colour?", "http://img/a.png"))
    assert key(chat(long + " first")) == key(chat(long + " second"))
    assert key(chat("first")) != key(chat("second"))
    assert key(chat("same", "http://img/a.png")) != key(chat("same", "http://img/b.png"))
    assert key(chat("same", "data:image/png;base64,AAAA")) != key(chat("same", "data:image/png;base64,AAAB"))
    with_system = chat("q")
    with_system["messages"].insert(0, {"role": "system", "content": "you are helpful"})
    assert key(with_system) == key(chat("q"))  # a shared system prompt would key every request alike
    assert key({"prompt": long + "a"}, "completion") == key({"prompt": long + "b"}, "completion")
    assert key({"prompt": list(range(300))}, "completion") == key({"prompt": list(range(257))}, "completion")
    assert key({"prompt": [1, 2]}, "completion") != key({"prompt": [1, 3]}, "completion")
    assert key({"prompt": "ab"}, "completion") != key({"prompt": "ab"}, "chat")


def test_prefill_rendezvous_and_decode_least_loaded():
    registry = ServerRegistry(failure_threshold=2, load_factor=1.25)
    info = {
        r: ServerInfo(r, "m", "tcp://x:1" if r == "decode" else None, ("zmq",), 1, 1)
        for r in ("prefill", "decode")
    }
    for i in range(3):
        registry.register(f"http://p{i}:1", "prefill", info["prefill"])
        registry.register(f"http://d{i}:1", "decode", info["decode"])
    keys = [affinity_key("completion", {"prompt": f"prompt {i}"}, 512, 256) for i in range(60)]
    chosen = [registry.choose_prefill(k, set()).url for k in keys]
    assert chosen == [registry.choose_prefill(k, set()).url for k in keys]  # stable
    assert len(set(chosen)) == 3  # and spread
    favourite = registry.get(chosen[0])
    favourite.in_flight = 5  # a hot prefix: bounded load spills to the next in rendezvous order
    assert registry.choose_prefill(keys[0], set()) is not favourite
    assert registry.choose_prefill(keys[0], {chosen[0]}) is not favourite
    favourite.in_flight = 0

    d0, d1, d2 = (registry.get(f"http://d{i}:1") for i in range(3))
    d0.in_flight, d1.in_flight, d2.in_flight = 2, 1, 3
    assert registry.choose_decode(set()) is d1
    assert registry.choose_decode({d1.url}) is d0
    d0.in_flight = d1.in_flight = d2.in_flight = 0
    d0.dispatched, d1.dispatched, d2.dispatched = 4, 4, 3
    assert registry.choose_decode(set()) is d2  # equal load: the one sent the fewest so far

    registry.record_failure(d2, "probe")
    assert d2.selectable  # one strike is not enough
    registry.record_failure(d2, "probe")
    assert not d2.selectable and registry.choose_decode({d1.url, d0.url}) is None
    registry.record_success(d2)
    assert d2.selectable and d2.strikes == 0
    for server in (d0, d1, d2):  # every decode server fails its probes (busy with long steps, or dead)
        registry.record_failure(server, "probe")
        registry.record_failure(server, "probe")
    assert (
        registry.choose_decode(set()) is not None
    )  # tried anyway: a connect failure is a strike and a retry
    for server in (d0, d1, d2):
        registry.record_success(server)


# -- relaying -----------------------------------------------------------------------------------------
def test_non_stream_request_is_routed_and_annotated(pd):
    resp = pd.http.post(f"{pd.url}/v1/chat/completions", json=chat("hi", "http://img/x.png"))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "hello \u00e9"
    route = route_of(resp)
    prefill, decode = pd.by_url(route["prefill"]), pd.by_url(route["decode"])
    assert route["backend"] == "zmq" and route["kv_bytes"] == "12345" and route["kv_transfer_ms"] == "1.23"
    assert route["encoded_by"] == f"standin_{prefill.port}__"  # ';', ' ' and 'é' cannot go in the header
    sent_p, sent_d = prefill.requests[-1], decode.requests[-1]
    room = sent_d["body"]["kv_transfer_params"]["room"]
    assert sent_d["body"]["kv_transfer_params"] == {"room": room} and route["room"] == room
    assert sent_p["body"]["kv_transfer_params"] == {
        "room": room,
        "decode_bootstrap": f"tcp://127.0.0.1:{decode.port}",
        "backend": "zmq",
    }
    for sent in (sent_p, sent_d):
        assert sent["headers"]["x-mmserve-cluster-token"] == TOKEN["X-MMServe-Cluster-Token"]
        assert sent["body"]["messages"] == chat("hi", "http://img/x.png")["messages"]


def test_same_image_same_prefill_server_and_spread(pd):
    def prefill_of(body: dict) -> str:
        resp = pd.http.post(f"{pd.url}/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return route_of(resp)["prefill"]

    assert len({prefill_of(chat(f"question {i}", "http://img/cat.png")) for i in range(4)}) == 1
    assert len({prefill_of(chat("describe", f"http://img/{i}.png")) for i in range(12)}) > 1


def test_sse_is_relayed_byte_for_byte(pd):
    with pd.http.stream("POST", f"{pd.url}/v1/chat/completions", json=chat("hi", stream=True)) as resp:
        body = resp.read()
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert body == b"".join(sse_chunks(3))
    assert "kv_bytes=12345" in resp.headers["x-mmserve-route"]


def test_decode_is_the_least_loaded(pd):
    for s in pd.decode:
        s.behaviour.chunks, s.behaviour.chunk_delay_s = 40, 0.05
    with pd.http.stream("POST", f"{pd.url}/v1/chat/completions", json=chat("a", stream=True)) as first:
        busy = route_of(first)["decode"]
        events = first.iter_raw()  # held: a dropped iterator closes the connection
        next(events)
        others = set()
        for _ in range(2):
            with pd.http.stream("POST", f"{pd.url}/v1/chat/completions", json=chat("b", stream=True)) as r:
                others.add(route_of(r)["decode"])
                assert pd.servers()[busy]["in_flight"] == 1
        assert busy not in others and len(others) == 2  # the two idle ones, not the busy one


def test_decode_at_capacity_is_retried_elsewhere_then_503(pd):
    refusing = pd.decode[0]
    refusing.behaviour.refuse_kv = True
    for i in range(3):
        resp = pd.http.post(f"{pd.url}/v1/chat/completions", json=chat(f"q{i}"))
        assert resp.status_code == 200 and route_of(resp)["decode"] != refusing.url
    assert eventually(lambda: len(refusing.aborted) >= 1)  # its rooms were closed by the router
    tried = [r["body"]["kv_transfer_params"]["decode_bootstrap"] for p in pd.prefill for r in p.requests]
    assert f"tcp://127.0.0.1:{refusing.port}" in tried

    for s in pd.decode:
        s.behaviour.refuse_kv = True
    resp = pd.http.post(f"{pd.url}/v1/chat/completions", json=chat("again"))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "decode_at_capacity"
    assert resp.headers["retry-after"] == "1" and route_of(resp)["attempts"] == "3"
    text = pd.http.get(f"{pd.url}/metrics").text
    assert metric(text, "mmserve_router:retries_total", reason="decode_at_capacity") >= 2


def test_prefill_error_passes_through_and_aborts_the_room(pd):
    err = {
        "error": {"message": "image too large", "type": "invalid_request_error", "code": "media_too_large"}
    }
    for s in pd.prefill:
        s.behaviour.prefill_error = (400, err)
    resp = pd.http.post(f"{pd.url}/v1/chat/completions", json=chat("x", stream=True))
    assert resp.status_code == 400 and resp.json() == err
    decode = pd.by_url(route_of(resp)["decode"])
    assert eventually(lambda: route_of(resp)["room"] in decode.aborted)
    assert eventually(lambda: all(s["in_flight"] == 0 for s in pd.servers().values()))


def test_early_decode_error_and_timeouts_end_the_wait(pd):
    err = {"error": {"message": "bad", "type": "invalid_request_error", "code": "invalid_parameter"}}
    for s in pd.prefill:
        s.behaviour.prefill_delay_s = 3.0
    for s in pd.decode:
        s.behaviour.decode_error = (400, err)
    start = time.monotonic()
    resp = pd.http.post(f"{pd.url}/v1/chat/completions", json=chat("x"))
    assert resp.status_code == 400 and resp.json() == err  # without waiting for the prefill
    assert time.monotonic() - start < 2.0

    for s in pd.decode:
        s.behaviour.decode_error = None
    url, router = pd.router(request_timeout_s=0.5)
    start = time.monotonic()
    resp = pd.http.post(f"{url}/v1/chat/completions", json=chat("x"))
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "prefill_timeout"
    assert time.monotonic() - start < 2.0
    pd.thread.stop(router)


def test_stream_break_ends_with_an_error_event(pd):
    for s in pd.decode:
        s.behaviour.chunks, s.behaviour.break_after_chunks = 6, 9
    with pd.http.stream("POST", f"{pd.url}/v1/chat/completions", json=chat("x", stream=True)) as resp:
        body = resp.read()
    assert resp.status_code == 200
    written = b"".join(sse_chunks(6)[:9])
    complete = written[: written.rfind(b"\n\n") + 2]
    assert body.startswith(complete)
    events = body[len(complete) :].split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""] and len(events) == 3
    assert json.loads(events[0][len(b"data: ") :])["error"]["code"] == "decode_server_failed"


def test_non_stream_break_is_502(pd):
    for s in pd.decode:
        s.behaviour.break_after_chunks = 0
    resp = pd.http.post(f"{pd.url}/v1/chat/completions", json=chat("x"))
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "decode_server_failed"
    assert "prefill=" in resp.headers["x-mmserve-route"]


def test_client_disconnect_closes_the_upstream(pd):
    for s in pd.decode:
        s.behaviour.chunks, s.behaviour.chunk_delay_s = 200, 0.05
    with pd.http.stream("POST", f"{pd.url}/v1/chat/completions", json=chat("x", stream=True)) as resp:
        decode, room = pd.by_url(route_of(resp)["decode"]), route_of(resp)["room"]
        next(resp.iter_raw())
    assert eventually(lambda: room in decode.aborted)
    assert eventually(lambda: pd.servers()[decode.url]["in_flight"] == 0)


def test_bad_requests(pd):
    url = f"{pd.url}/v1/chat/completions"
    resp = pd.http.post(url, content=b"{not json")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"
    assert pd.http.post(url, content=b"[1]").status_code == 400
    assert pd.http.post(url, content=b'{"x": NaN}').status_code == 400
    resp = pd.http.post(url, json={**chat("x"), "kv_transfer_params": {"room": "mine"}})
    assert resp.status_code == 400 and "kv_transfer_params" in resp.json()["error"]["message"]
    assert not any(s.requests for s in pd.prefill + pd.decode)
    assert pd.http.get(f"{pd.url}/v1/models").json()["data"][0]["id"] == "standin-model"


def test_metrics(pd):
    assert pd.http.post(f"{pd.url}/v1/completions", json={"prompt": "hi"}).status_code == 200
    text = pd.http.get(f"{pd.url}/metrics").text
    assert metric(text, "mmserve_router:requests_total", status="200") >= 1
    assert metric(text, "mmserve_router:kv_transfer_bytes_total") >= 12345
    assert metric(text, "mmserve_router:kv_transfer_seconds_count") >= 1
    assert metric(text, "mmserve_router:time_to_first_byte_seconds_count") >= 1
    assert metric(text, "mmserve_router:in_flight_requests", server=pd.prefill[0].url, role="prefill") == 0


# -- health and membership ----------------------------------------------------------------------------
def test_unhealthy_servers_are_not_chosen(pd):
    sick = pd.prefill[0]
    sick.behaviour.healthy = False
    assert eventually(lambda: not pd.servers()[sick.url]["healthy"])
    assert pd.servers()[sick.url]["strikes"] >= 2
    for i in range(8):
        resp = pd.http.post(f"{pd.url}/v1/chat/completions", json=chat(f"q{i}"))
        assert route_of(resp)["prefill"] != sick.url
    sick.behaviour.healthy = True
    assert eventually(lambda: pd.servers()[sick.url]["healthy"])


def test_connect_failure_is_a_strike_and_a_retry(pd):
    dead = pd.thread.serve_standin(Standin("decode", SECRET))
    live = pd.decode[0]
    url, router = pd.router(static=False, health_interval_s=60)
    for server, role in ((pd.prefill[0], "prefill"), (dead, "decode"), (live, "decode")):
        body = {"url": server.url, "role": role}
        assert pd.http.post(f"{url}/register_server", json=body, headers=TOKEN).status_code == 200
    pd.thread.stop(pd.thread.by_port[dead.port])
    for i in range(2):  # one of the two goes to the dead server first (equal load, fewer dispatched)
        resp = pd.http.post(f"{url}/v1/chat/completions", json=chat(f"q{i}"))
        assert resp.status_code == 200 and route_of(resp)["decode"] == live.url
    assert pd.servers(url)[dead.url]["last_error"].startswith("dispatch: Connect")
    text = pd.http.get(f"{url}/metrics").text
    assert metric(text, "mmserve_router:retries_total", reason="decode_unreachable") >= 1
    pd.thread.stop(router)


def test_a_server_refusing_the_routers_token_is_named_once_in_the_log_and_in_health(pd, caplog):
    """A server restarted with another secret (or none) answers the router's handoffs 401 / 403: the router
    names the cause once per change in its log, in /health and to the client (a 502, not the server's 401,
    which would read as the client's own credentials failing), and uses the server again once it accepts."""
    p = pd.thread.serve_standin(Standin("prefill", SECRET))
    d = pd.thread.serve_standin(Standin("decode", SECRET))
    url, router = pd.router(static=False, prefill_urls=(p.url,), decode_urls=(d.url,), health_interval_s=0.1)
    caplog.set_level(logging.INFO, logger="mmserve.router")
    assert eventually(lambda: pd.http.get(f"{url}/health").status_code == 200)
    for standin, secret, status in ((d, "another-secret-0123456789", 401), (p, None, 403)):
        standin.secret = secret  # "restarted" with another secret (decode) or none (prefill)
        cause = f"server {standin.url} refused the router's cluster token: {status}"
        for i in range(3):
            resp = pd.http.post(f"{url}/v1/chat/completions", json=chat(f"q{i}"))
            message = resp.json()["error"]["message"]
            assert resp.status_code in (502, 503), message
            assert cause in message and "--cluster-secret" in message, message
        time.sleep(0.5)  # probes go on meanwhile: still one warning
        health = pd.http.get(f"{url}/health")
        assert health.status_code == 503
        assert any(cause in r and "set the same --cluster-secret" in r for r in health.json()["reasons"])
        assert pd.servers(url)[standin.url]["refused"].startswith(cause)
        logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert sum(cause in line for line in logged) == 1, logged
        standin.secret = SECRET
        assert eventually(lambda: pd.http.get(f"{url}/health").status_code == 200)
        assert pd.http.post(f"{url}/v1/chat/completions", json=chat("again")).status_code == 200
        assert "refused" not in pd.http.get(f"{url}/health").text
    pd.thread.stop(router)


def test_registration_and_health(pd):
    url, router = pd.router(static=False)
    assert pd.http.get(f"{url}/health").status_code == 503
    register = f"{url}/register_server"
    p, d = pd.prefill[0], pd.decode[0]
    resp = pd.http.post(register, json={"url": p.url, "role": "prefill"}, headers=TOKEN)
    assert resp.status_code == 200 and resp.json()["role"] == "prefill"
    health = pd.http.get(f"{url}/health")
    assert health.status_code == 503 and "no healthy decode server" in health.json()["reasons"]
    resp = pd.http.post(register, json={"url": d.url, "role": "prefill"}, headers=TOKEN)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "role_mismatch"
    resp = pd.http.post(register, json={"url": "http://127.0.0.1:9", "role": "decode"}, headers=TOKEN)
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "server_unreachable"
    assert pd.http.post(register, json={"url": "ftp://x", "role": "decode"}, headers=TOKEN).status_code == 400
    resp = pd.http.post(register, json={"url": d.url + "/", "role": "decode"}, headers=TOKEN)
    assert resp.status_code == 200 and resp.json()["bootstrap"] == f"tcp://127.0.0.1:{d.port}"
    assert pd.http.get(f"{url}/health").status_code == 200
    resp = pd.http.post(f"{url}/v1/chat/completions", json=chat("hello"))
    assert resp.status_code == 200 and route_of(resp)["decode"] == d.url
    assert {u: s["in_flight"] for u, s in pd.servers(url).items()} == {p.url: 0, d.url: 0}
    unregister = f"{url}/unregister_server"
    assert pd.http.post(unregister, json={"url": d.url}, headers=TOKEN).status_code == 200
    assert pd.http.post(unregister, json={"url": d.url}, headers=TOKEN).status_code == 404
    assert pd.http.get(f"{url}/health").status_code == 503
    resp = pd.http.post(f"{url}/v1/chat/completions", json=chat("hello"))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_decode_server"
    pd.thread.stop(router)


def test_control_plane_lockdown_and_api_key(pd):
    assert pd.http.get(f"{pd.url}/servers").status_code == 401
    assert pd.http.get(f"{pd.url}/servers", headers={"X-MMServe-Cluster-Token": "0" * 64}).status_code == 401
    closed, closed_server = pd.router(static=False, cluster_secret=None)
    assert pd.http.get(f"{closed}/servers").status_code == 403
    assert pd.http.post(f"{closed}/register_server", json={"url": pd.decode[0].url}).status_code == 403
    anon, anon_server = pd.router(static=False, cluster_secret=None, enable_anonymous_registration=True)
    assert pd.http.get(f"{anon}/servers").status_code == 200
    # It has no secret to show the servers, which keep their /disagg/info closed to it.
    resp = pd.http.post(f"{anon}/register_server", json={"url": pd.decode[0].url, "role": "decode"})
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "server_info_refused"
    open_decode = pd.thread.serve_standin(Standin("decode", anonymous=True))
    resp = pd.http.post(f"{anon}/register_server", json={"url": open_decode.url, "role": "decode"})
    assert resp.status_code == 200

    keyed, keyed_server = pd.router(api_key="sk-test")
    resp = pd.http.post(f"{keyed}/v1/chat/completions", json=chat("x"))
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert pd.http.get(f"{keyed}/v1/models").status_code == 401
    auth = {"Authorization": "Bearer sk-test"}
    assert pd.http.post(f"{keyed}/v1/chat/completions", json=chat("x"), headers=auth).status_code == 200
    assert not any("authorization" in r["headers"] for s in pd.prefill + pd.decode for r in s.requests)
    assert pd.http.get(f"{keyed}/health").status_code == 200  # only /v1/* needs the key
    for server in (closed_server, anon_server, keyed_server):
        pd.thread.stop(server)


# -- flags ----------------------------------------------------------------------------------------------
def test_router_flags():
    from mmserve.cli import build_parser
    from mmserve.disagg.cli import router_config_from_args

    argv = "router --prefill http://a:1 http://b:2 --decode http://c:3 --port 9001 --kv-transfer-backend mooncake"
    args = build_parser().parse_args([*argv.split(), "--request-timeout-s", "30"])
    cfg = router_config_from_args(args, prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode))
    assert cfg.prefill_urls == ("http://a:1", "http://b:2") and cfg.decode_urls == ("http://c:3",)
    assert (cfg.port, cfg.kv_transfer_backend, args.request_timeout_s) == (9001, "mooncake", 30.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--kv-transfer-backend", "rdma"])
