from __future__ import annotations

from mmserve.demo import run_demo


def test_demo_runs_the_full_stack(tmp_path, capsys):
    assert run_demo(str(tmp_path / "tiny"), max_tokens=6)
    out = capsys.readouterr().out
    assert (
        out.count("encoded by http://127.0.0.1:") == 4
    )  # three plain requests and the streamed one, via EPD
    assert "1 embedding-cache hit(s)" in out  # the repeated image
    assert "server stopped cleanly (exit 0)" in out
