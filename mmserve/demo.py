"""`mmserve demo` (`make demo`): the whole stack on the embedded tiny model, through the official client.

Builds the tiny checkpoint if it is missing and starts the full Encode-Prefill-Decode pipeline on free
loopback ports: `mmserve serve --encoder-workers 1 --prefill-workers 1 --decode-workers 1` (an encoder
process, a prefill server without vision weights that sends media to it, a decode server, and
`mmserve router` in front). It sends chat requests with generated images through the `openai` client (one
streamed, one repeating an image so the caches show), prints each answer with where its time went and its
path (encoder, prefill server, decode server, KV bytes moved and how long that took), and shuts it all down.

`mmserve demo --ui` (`make demo-ui`): one `mmserve serve --encoder-workers 2` with the browser playground and
dashboard (mmserve.server.routes_ui), a few requests so the dashboard has something to show, then the server
stays up until Ctrl-C.
"""

from __future__ import annotations

import base64
import io
import os
import tempfile
import time

from PIL import Image, ImageDraw

from mmserve.testing.server_process import start_server
from mmserve.testing.tiny_models import ensure_tiny_model

DEFAULT_MODEL_DIR = os.path.join("models", "tiny-qwen2-vl")
UI_DEMO_PORT = 8000


def shape_image(color: tuple[int, int, int], box: tuple[int, int, int, int], size=(96, 64)) -> str:
    """A generated picture (a coloured box on blue) as a PNG data URI."""
    img = Image.new("RGB", size, (30, 60, 200))
    ImageDraw.Draw(img).rectangle(box, fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _message(text: str, *images: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": uri}} for uri in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _timings_line(extra: dict, usage) -> str:
    t = extra["timings"]
    return (f"queue {1000 * t['queue_s']:.1f} ms | encode {1000 * t['encode_s']:.1f} ms | prefill "
            f"{1000 * t['prefill_s']:.1f} ms | decode {1000 * t['decode_s']:.1f} ms | prompt {usage.prompt_tokens} "
            f"tokens ({usage.prompt_tokens_details.cached_tokens} cached), {extra['mm_items']} item(s) encoded by "
            f"{extra['encoded_by']}, {extra['mm_cache_hits']} embedding-cache hit(s)")  # fmt: skip


def _path_line(route: str) -> str:
    """The router's `x-mmserve-route` header, as a sentence."""
    path = dict(part.strip().split("=", 1) for part in route.split(";") if "=" in part)
    if not path:
        return "path: (no route header)"
    return (
        f"path: encoder {path.get('encoded_by', 'none')} -> prefill {path.get('prefill')} -> decode "
        f"{path.get('decode')} | KV {int(path.get('kv_bytes', 0)) / 1024:.1f} KiB over {path.get('backend')} "
        f"in {float(path.get('kv_transfer_ms', 0)):.2f} ms"
    )


def run_demo(model_dir: str = DEFAULT_MODEL_DIR, max_tokens: int = 16) -> bool:
    import openai

    start = time.perf_counter()
    ensure_tiny_model(model_dir)
    red = shape_image((220, 40, 40), (20, 12, 60, 50))
    green = shape_image((40, 200, 60), (50, 8, 90, 40))
    with tempfile.TemporaryDirectory() as logs:
        # E/P/D on one machine: an encoder, a prefill and a decode server behind the router (this URL).
        server = start_server(
            model_dir,
            *("--kv-cache-mb", "64", "--language-only", "--encoder-workers", "1"),
            *("--prefill-workers", "1", "--decode-workers", "1"),
            log_dir=logs,
            served_model_name="tiny-qwen2-vl",
        )
        print(f"server up at {server.url} in {time.perf_counter() - start:.1f}s (model {model_dir})")
        print(
            "(the tiny model has random weights: its text is noise; the demo shows the path and the timings)"
        )
        ok = True
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="demo", max_retries=0, timeout=60)
            requests = [
                ("one image", _message("What shape is in the picture?", red)),
                ("two images", _message("What changed between these two pictures?", red, green)),
                ("same image again", _message("What colour is the shape?", red)),
            ]
            for name, messages in requests:
                raw = client.chat.completions.with_raw_response.create(
                    model="tiny-qwen2-vl", messages=messages, max_tokens=max_tokens, temperature=0
                )
                out = raw.parse()
                print(
                    f"\n[{name}] {out.choices[0].message.content!r} (finish: {out.choices[0].finish_reason})"
                )
                print("  " + _timings_line(out.model_extra["mmserve"], out.usage))
                print("  " + _path_line(raw.headers.get("x-mmserve-route", "")))
            print("\n[streamed] ", end="", flush=True)
            raw = client.chat.completions.with_raw_response.create(
                model="tiny-qwen2-vl",
                messages=_message("Describe the picture.", green),
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            stream, route = raw.parse(), raw.headers.get("x-mmserve-route", "")
            extra, usage = None, None
            for chunk in stream:
                if chunk.choices:
                    print(chunk.choices[0].delta.content or "", end="", flush=True)
                extra = (chunk.model_extra or {}).get("mmserve", extra)  # its own chunk, after the finish
                usage = chunk.usage or usage
            print("\n  " + _timings_line(extra, usage))
            print("  " + _path_line(route))
        except Exception as e:  # print the server's side too, then fail
            ok = False
            print(f"demo request failed: {e}\n--- server log ---\n{server.log()}")
        finally:
            code = server.stop()
        print(f"\nserver stopped cleanly (exit {code}); demo took {time.perf_counter() - start:.1f}s")
        ui_url = f"http://127.0.0.1:{UI_DEMO_PORT}/"
        print(f"\nPlayground (and /dashboard): {ui_url} while `make demo-ui` runs (until Ctrl-C)")
        return ok and code == 0


def run_ui_demo(model_dir: str = DEFAULT_MODEL_DIR, port: int = UI_DEMO_PORT, max_tokens: int = 16) -> bool:
    """A server with two encoder workers and the browser UI on `port`, up until Ctrl-C."""
    import openai

    ensure_tiny_model(model_dir)
    red = shape_image((220, 40, 40), (20, 12, 60, 50))
    green = shape_image((40, 200, 60), (50, 8, 90, 40))
    print(f"starting {model_dir} with two encoder workers on port {port} ...", flush=True)
    with tempfile.TemporaryDirectory() as logs:
        try:
            server = start_server(
                model_dir,
                *("--kv-cache-mb", "64", "--encoder-workers", "2"),
                log_dir=logs,
                served_model_name="tiny-qwen2-vl",
                port=port,
            )
        except AssertionError as e:
            print(f"the server did not start (another on port {port}? `mmserve demo --ui --port N`):\n{e}")
            return False
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="demo", max_retries=0, timeout=60)
            for text, image in (("What shape is this?", red), ("And this one?", green), ("Again?", red)):
                client.chat.completions.create(
                    model="tiny-qwen2-vl", messages=_message(text, image), max_tokens=max_tokens
                )
            print(f"\nPlayground: {server.url}/\nDashboard:  {server.url}/dashboard")
            print("(tiny random-weight model: its text is noise; Ctrl-C stops the server)", flush=True)
            while server.proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            code = server.stop()
        print(f"server stopped (exit {code})")
        return code == 0
