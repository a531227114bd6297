"""The playground (/) and the dashboard (/dashboard) in a real browser: headless Chromium driven by Selenium,
against one real server (the tiny Qwen2-VL, two encoder workers, an API key).

Needs Debian's `chromium` and `chromium-driver` (`make test` installs them when missing); without them this
module FAILS naming the install command, it never skips. Any error in the browser's console (a page error, a
failed request, a CSP violation) fails the test that caused it.

Screenshots go to pytest's temporary directory (`<basetemp>/ui-screenshots*/`, the path is printed). To refresh
the README's, write them to docs/img instead (more traffic first, so the dashboard's charts have a history):
    MMSERVE_UI_SCREENSHOTS=docs/img .venv/bin/python -m pytest -q -s tests/test_ui_browser.py
"""

from __future__ import annotations

import base64
import io
import math
import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageDraw
from selenium import webdriver  # a dev dependency (pyproject.toml)
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

import mmserve
from mmserve.server.routes_ui import STATIC_DIR
from mmserve.server.ui_stats import quantile
from mmserve.testing.server_process import ServerHandle, start_server

API_KEY = "ui-test-key-7f3a"
CHROMIUM, CHROMEDRIVER = "chromium", "chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver (or `make test`, which does it)"
WAIT_S = 30.0  # the longest any browser wait may take
SCREENSHOTS_ENV = "MMSERVE_UI_SCREENSHOTS"
CHROMIUM_FLAGS = (
    *("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,900"),
    # nothing of the browser's own: the only requests are the pages'
    *("--no-first-run", "--disable-extensions", "--disable-background-networking", "--disable-sync"),
    "--disable-component-update",
)


# -- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("ui-server"))
    args = ("--encoder-workers", "2", "--api-key", API_KEY, "--kv-cache-mb", "16")
    handle = start_server(tiny_qwen2_vl, *args, log_dir=logs)
    yield handle
    assert handle.stop() == 0


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where screenshots go: pytest's temporary directory, or $MMSERVE_UI_SCREENSHOTS (docs/img)."""
    target = os.environ.get(SCREENSHOTS_ENV)
    path = Path(target) if target else tmp_path_factory.mktemp("ui-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    yield path
    print(f"\nUI screenshots: {path.resolve()}")


@pytest.fixture(scope="module")
def browser():
    missing = [b for b in (CHROMIUM, CHROMEDRIVER) if shutil.which(b) is None]
    if missing:
        pytest.fail(f"the browser tests need {' and '.join(missing)}: {INSTALL}", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


# -- helpers ----------------------------------------------------------------------------------------------
def console_errors(driver) -> list[str]:
    """Errors logged in the browser's console since the last call (page errors, failed loads, CSP)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def wait(driver, condition, timeout_s: float = WAIT_S, what: str = ""):
    """`condition`'s first truthy value within `timeout_s`; else fails with `what` and the console's errors."""
    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.05).until(condition)
    except TimeoutException:
        pytest.fail(f"{what} (after {timeout_s}s); console errors: {console_errors(driver)}")


def open_page(driver, url: str) -> None:
    """Load a UI page; enter the API key when it asks (it does once per tab); wait until it is ready."""
    driver.get(url)

    def ready_or_asking(d):
        if is_ready(d):
            return "ready"
        return "asking" if d.find_elements(By.CSS_SELECTOR, "#key-dialog[open]") else False

    if wait(driver, ready_or_asking, what=f"{url}: neither ready nor asking for the key") == "asking":
        driver.find_element(By.ID, "key-input").send_keys(API_KEY)
        driver.find_element(By.ID, "key-submit").click()
        wait(driver, is_ready, what=f"{url}: not ready after the key")


def is_ready(driver) -> bool:
    return driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true"


def same_origin_resources(driver, origin: str) -> list[str]:
    """URLs of every resource the page loaded that is NOT from `origin` (should be none)."""
    urls = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    return [u for u in urls if not u.startswith(origin + "/")]


def shape_png(path: Path) -> Path:
    img = Image.new("RGB", (96, 64), (30, 60, 200))
    ImageDraw.Draw(img).rectangle((20, 12, 60, 50), fill=(220, 40, 40))
    img.save(path, format="PNG")
    return path


DROP_AND_PASTE = """
const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
const files = (name) => {
  const data = new DataTransfer();
  data.items.add(new File([bytes], name, { type: "image/png" }));
  return data;
};
const chat = document.getElementById("chat");
chat.dispatchEvent(new DragEvent("dragenter", { dataTransfer: files("dropped.png"), bubbles: true }));
chat.dispatchEvent(new DragEvent("drop", { dataTransfer: files("dropped.png"), bubbles: true, cancelable: true }));
document.dispatchEvent(new ClipboardEvent("paste", { clipboardData: files("pasted.png"), bubbles: true }));
"""


def send(driver, text: str, max_tokens: int) -> None:
    field = driver.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()


def answers(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")


def wait_answered(driver, count: int):
    def done(d) -> bool:
        return len(d.find_elements(By.CSS_SELECTOR, ".message.assistant[data-done]")) == count

    wait(driver, done, what=f"answer {count} did not finish")
    return answers(driver)[count - 1]


def encoder_rows(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#encoders tbody tr[data-url]")


def chart_value(driver, chart: str) -> str:
    """The latest value in a chart's legend ("–" before it has data)."""
    return driver.execute_script(f"return document.querySelector('#{chart} .legend b')?.textContent ?? ''")


# -- without a server -------------------------------------------------------------------------------------
def test_disable_ui_serves_no_page():
    from fastapi.testclient import TestClient

    from mmserve.cli import build_parser, server_config_from_args
    from mmserve.server.api import build_app
    from mmserve.server.metrics import ServerMetrics

    def app(*flags: str):
        cfg = server_config_from_args(build_parser().parse_args(["serve", "tiny", *flags]))
        return build_app(cfg, client=None, tokenizer=None, family=None, metrics=ServerMetrics("tiny"))

    with TestClient(app("--disable-ui")) as http:
        for path in ("/", "/dashboard", "/ui/static/style.css", "/ui/api/config", "/ui/api/stats"):
            assert http.get(path).status_code == 404, path
    with TestClient(app()) as http:  # the same files are there without the flag
        assert http.get("/ui/static/style.css").status_code == 200
        assert http.get("/ui/api/config").json() == {"auth_required": False, "version": mmserve.__version__}


def test_quantiles_interpolate_inside_buckets_over_a_window():
    then = [(0.1, 2.0), (0.5, 2.0), (1.0, 2.0), (math.inf, 2.0)]  # two observations before the window
    now = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (math.inf, 12.0)]  # 4 in (0.1, 0.5], 4 in (0.5, 1], 2 above
    assert quantile(0.5, now, then) == pytest.approx(0.5 + 0.5 * (5 - 4) / 4)  # rank 5 of 10
    assert quantile(0.2, now, then) == pytest.approx(0.1 + 0.4 * 2 / 4)
    assert quantile(0.99, now, then) == 1.0  # in the +Inf bucket: the largest finite bound
    assert quantile(0.5, now, now) is None  # nothing observed in the window
    assert quantile(0.5, now, None) == pytest.approx(0.5 + 0.5 * (6 - 6) / 4)  # since start: rank 6 of 12


def test_assembler_reports_who_encoded_each_item_and_the_transfer_time():
    """What an answer's breakdown shows in EPD: parts of two encoders, the last one sent 0.25 s ago."""
    import torch

    from mmserve.multimodal.items import MAIN, ItemEmbedding, Modality
    from mmserve.runtime.receiver import PartAssembler
    from mmserve.transport.embedding_wire import WIRE_VERSION, EmbeddingItem, PartHeader

    def part(index: int, encoder: str, items: list[int], sent_at: float, rid: str = "r", of: int = 2):
        embedded = [
            EmbeddingItem(i, ItemEmbedding(Modality.IMAGE, bytes(16), {MAIN: torch.zeros(2, 4)}))
            for i in items
        ]
        return PartHeader(WIRE_VERSION, rid, index, of, encoder, [], sent_at=sent_at), embedded

    assembler = PartAssembler()
    assert assembler.expect("r", ["image"] * 3, num_parts=2, timeout_s=10) == []
    assert assembler.add(*part(1, "http://b", [1], time.time() - 5)) == []
    (done,) = assembler.add(*part(0, "http://a", [0, 2], time.time() - 0.25))
    assert done.item_encoders == ["http://a", "http://b", "http://a"]  # prompt order
    assert 0.25 <= done.transfer_s < 5  # the part that completed the request
    assembler.expect("s", ["image"], num_parts=1, timeout_s=10)
    failover = part(0, "local (failover)", [0], 0.0, rid="s", of=1)  # encoded by the engine: no send time
    (local,) = assembler.add(*failover)
    assert local.transfer_s == 0.0


# -- HTTP: files, headers, the key ------------------------------------------------------------------------
def test_pages_and_files_have_their_content_types_and_a_strict_csp(server: ServerHandle):
    expected = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    urls = {"/": ".html", "/dashboard": ".html"}
    urls |= {f"/ui/static/{p.name}": p.suffix for p in STATIC_DIR.iterdir() if p.suffix != ".html"}
    assert len(urls) >= 9  # two pages, their modules, the stylesheet, the icon
    for path, suffix in urls.items():
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200, path
        assert r.headers["content-type"].split(";")[0] == expected[suffix], path
        csp = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
        assert csp["default-src"] == csp["script-src"] == csp["style-src"] == csp["connect-src"] == "'self'"
        assert csp["object-src"] == csp["base-uri"] == csp["frame-ancestors"] == "'none'"
        assert "unsafe" not in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
        assert API_KEY not in r.text  # the pages never carry the key
    for page in ("/", "/dashboard"):  # no inline code: every script is a file, no style or handler attributes
        html = httpx.get(server.url + page, timeout=10).text
        assert re.findall(r"<script\b[^>]*>", html) and all(
            ' src="/ui/static/' in tag for tag in re.findall(r"<script\b[^>]*>", html)
        )
        assert not re.search(r"<style|\sstyle=|\son[a-z]+=|javascript:", html, re.IGNORECASE)
    for bad in ("/ui/static/..%2Froutes_ui.py", "/ui/static/.hidden.js", "/ui/static/nope.js"):
        assert httpx.get(server.url + bad, timeout=10).status_code == 404, bad


def test_api_calls_need_the_key_the_pages_do_not(server: ServerHandle):
    url, key = server.url, {"Authorization": f"Bearer {API_KEY}"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.get(url + "/ui/api/config", timeout=10).json()["auth_required"] is True
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=10).status_code == 401
    assert httpx.get(url + "/ui/api/stats", timeout=10).status_code == 401  # it names the encoders
    wrong = {"Authorization": "Bearer not-the-key"}
    assert httpx.get(url + "/ui/api/stats", headers=wrong, timeout=10).status_code == 401
    stats = httpx.get(url + "/ui/api/stats", headers=key, timeout=10)
    assert stats.status_code == 200 and len(stats.json()["encoders"]) == 2
    assert httpx.post(url + "/v1/chat/completions", json=chat, headers=key, timeout=30).status_code == 200


# -- the browser ------------------------------------------------------------------------------------------
def test_console_errors_are_seen(browser, server: ServerHandle):
    """The check every browser test ends with really sees page errors (else it could not fail)."""
    browser.get(server.url + "/ui/static/favicon.svg")
    console_errors(browser)
    browser.execute_script("setTimeout(() => { throw new Error('planted page error'); }, 0)")
    wait(browser, lambda d: any("planted page error" in m for m in console_errors(d)), timeout_s=10)


PLAYGROUND_SEED = 7


def test_playground_streams_an_answer_with_its_breakdown(browser, server: ServerHandle, shots, tmp_path):
    if os.environ.get(SCREENSHOTS_ENV):
        browser.set_window_size(1400, 1300)  # for the docs: the whole conversation in view
    open_page(browser, server.url + "/")
    assert browser.find_element(By.ID, "model-name").text == "tiny"
    assert not browser.find_elements(By.CSS_SELECTOR, "#key-dialog")  # the key was accepted
    assert API_KEY not in browser.page_source  # nor is it written into the page
    png = base64.b64encode(shape_png(tmp_path / "shape.png").read_bytes()).decode()
    browser.execute_script(DROP_AND_PASTE, png)  # a file dropped on the chat, another pasted
    thumbs = browser.find_elements(By.CSS_SELECTOR, "#attachments .thumb")
    assert [t.get_attribute("title") for t in thumbs] == ["dropped.png (image)", "pasted.png (image)"]
    for _ in thumbs:
        browser.find_element(By.CSS_SELECTOR, "#attachments .thumb .remove").click()
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments .thumb")
    browser.find_element(By.ID, "file-input").send_keys(str(tmp_path / "shape.png"))  # the file picker
    assert len(browser.find_elements(By.CSS_SELECTOR, "#attachments .thumb img")) == 1
    # The tiny model samples its end-of-text id about once in 500 tokens at the default temperature: with a
    # random seed, one run in ~15 ended turn three before it had streamed enough to be seen streaming. A fixed
    # seed makes every turn the same answer on every run (one that is long enough).
    browser.find_element(By.ID, "seed").send_keys(str(PLAYGROUND_SEED))
    send(browser, "What shape is in the picture?", max_tokens=24)
    first = wait_answered(browser, 1)
    assert first.find_element(By.CSS_SELECTOR, ".content").text.strip()  # the answer's text arrived
    assert not first.find_elements(By.CSS_SELECTOR, ".error")
    breakdown = first.find_element(By.CSS_SELECTOR, "[data-testid=breakdown]")
    legend = breakdown.find_elements(By.CSS_SELECTOR, ".legend .item")
    segments = {e.get_attribute("data-segment"): e.text for e in legend}
    assert set(segments) >= {"encode", "transfer", "queue", "prefill", "decode"}
    assert all(re.search(r"\d", text) for text in segments.values())  # each with its time
    assert breakdown.find_elements(By.CSS_SELECTOR, ".bar .seg.decode")
    encoders = breakdown.find_element(By.CSS_SELECTOR, "[data-testid=item-encoders]").text
    assert re.fullmatch(r"image 1 → http://127\.0\.0\.1:\d+", encoders)  # one of the two encoder workers
    assert "embedding cache 0 of 1 item(s) hit" in breakdown.text

    # Turn two re-sends the image (the conversation so far): both caches hit.
    send(browser, "And what colour is it?", max_tokens=24)
    second = wait_answered(browser, 2).find_element(By.CSS_SELECTOR, "[data-testid=breakdown]").text
    assert "embedding cache 1 of 1 item(s) hit" in second
    assert re.search(r"prompt \d+ tokens, [1-9]\d* from the prefix cache", second)

    # Turn three: a long answer, seen while it streams (screenshot mid-answer), then stopped.
    send(browser, "Describe the picture in detail.", max_tokens=3000)

    def streaming_text(d):
        node = d.find_elements(By.CSS_SELECTOR, ".message.assistant.streaming .content")
        return node and len(node[0].text) > 120

    wait(browser, streaming_text, what="no streamed text while the answer was still streaming")
    browser.save_screenshot(str(shots / "playground.png"))
    browser.find_element(By.ID, "stop").click()
    third = wait_answered(browser, 3)
    assert "stopped" in third.text
    assert same_origin_resources(browser, server.url) == []
    assert console_errors(browser) == []


def test_dashboard_shows_the_server_and_both_encoders(browser, server: ServerHandle, shots):
    if os.environ.get(SCREENSHOTS_ENV):
        _traffic(server, seconds=40.0)  # for the docs: charts with some history
        browser.set_window_size(1400, 1420)  # the whole page
    key = {"Authorization": f"Bearer {API_KEY}"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, headers=key, timeout=30)
    assert r.status_code == 200  # at least one finished request, whichever tests ran before
    open_page(browser, server.url + "/dashboard")
    wait(browser, lambda d: len(encoder_rows(d)) == 2, what="the dashboard does not list two encoders")
    urls = [r.get_attribute("data-url") for r in encoder_rows(browser)]
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+", u) for u in urls) and len(set(urls)) == 2
    assert all("healthy" in r.text for r in encoder_rows(browser))
    cards = browser.find_element(By.ID, "cards").text
    assert re.search(r"Requests\n[1-9]", cards) and "2 / 2" in cards  # finished requests; healthy encoders
    wait(browser, lambda d: re.search(r"\d", chart_value(d, "chart-throughput")), what="charts without data")
    latency = browser.find_element(By.ID, "latency").text
    assert "time to first token" in latency and re.search(r"\d+(\.\d+)? ms", latency)
    status = browser.find_element(By.ID, "status-text").text
    assert status.startswith("live")
    wait(browser, lambda d: d.find_element(By.ID, "status-text").text != status, what="no next poll")
    browser.save_screenshot(str(shots / "dashboard.png"))
    assert same_origin_resources(browser, server.url) == []
    assert console_errors(browser) == []


def _traffic(server: ServerHandle, seconds: float) -> None:
    """Chats with images from two threads for `seconds` (docs screenshots only: not part of the test)."""
    deadline = time.monotonic() + seconds

    def run(seed: int) -> None:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            k = 0
            while time.monotonic() < deadline:
                buf = io.BytesIO()
                Image.new("RGB", (64, 48), ((seed * 50 + k * 37) % 256, 90, 160)).save(buf, format="PNG")
                url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
                content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]
                body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 32}
                http.post("/v1/chat/completions", json=body, timeout=60)
                k = (k + 1) % 4  # repeats: cache hits

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
