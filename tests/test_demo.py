from __future__ import annotations

from mmserve.demo import run_demo


def test_demo_runs_the_full_stack(tmp_path, capsys):
    assert run_demo(str(tmp_path / "tiny"), max_tokens=6)
    out = capsys.readouterr().out
    assert (
        out.count("encoded by http://127.0.0.1:") == 4
    )  # three plain requests and the streamed one, via EPD
    assert "1 embedding-cache hit(s)" in out  # the repeated image
    # E/P/D: every answer names its encoder, prefill and decode server and the KV moved between the last two.
    paths = [line for line in out.splitlines() if line.strip().startswith("path: encoder http://127.0.0.1:")]
    assert len(paths) == 4 and all(
        "-> decode http://127.0.0.1:" in p and " KiB over zmq in " in p for p in paths
    )
    assert "server stopped cleanly (exit 0)" in out
