from __future__ import annotations

from mmserve.demo import run_demo


def test_demo_core_pipeline_matches_hf(tmp_path, capsys):
    assert run_demo(str(tmp_path / "tiny"), max_new_tokens=6, chunk_tokens=5)
    out = capsys.readouterr().out
    assert "parity with HF generate: identical" in out
    assert "answer" in out
