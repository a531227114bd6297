"""`mmserve bench stages` on the tiny model: the tower and prefill chunks part by part against their floors."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from mmserve.bench.stage_profile import Recorder, blocks_of, hook_linears
from tests.test_bench_cli import run_cli

TOWER_PARTS = [
    "patch embed",
    "tower GEMMs",
    "tower attention (SDPA)",
    "norms, rotary, activations, adds",
    "merger",
    "rotary tables, cu_seqlens, outputs",
    "hand-off (wire encode + decode)",
]
PREFILL_PARTS = [
    "LM GEMMs",
    "prefill attention (SDPA)",
    "KV write + gather",
    "norms, rotary, activations, adds",
    "lm_head (sampled rows)",
    "embed, splice, metadata, final norm",
    "scheduler, sampler, outputs",
]


def test_bench_stages_breaks_the_tower_and_prefill_down_against_their_floors(tiny_qwen2_vl, tmp_path):
    out = tmp_path / "stages.json"
    args = ["--image-size", "32x32,96x96", "--images", "1,2", "--prefill-tokens", "24,64", "--rounds", "1"]
    done = run_cli("bench", "stages", "--model", tiny_qwen2_vl, *args, "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    stages = json.loads(out.read_text())["stages"]
    towers, prefills = stages[:4], stages[4:]
    assert [s["stage"].split(",")[0] for s in stages] == ["tower"] * 4 + ["prefill"] * 2
    for s in towers:
        assert [p["name"] for p in s["parts"]] == TOWER_PARTS
    for s in prefills:
        assert [p["name"] for p in s["parts"]] == PREFILL_PARTS
    for s in stages:
        parts = {p["name"]: p for p in s["parts"]}
        # the parts account for the whole stage, and the floor is the sum of the parts that have one
        assert abs(sum(p["ms"] for p in s["parts"]) - s["total_ms"]) < 0.05 * s["total_ms"], s
        assert s["floor_ms"] == sum(p["floor_ms"] or 0.0 for p in s["parts"]) > 0
        gemms = parts["tower GEMMs"] if "tower GEMMs" in parts else parts["LM GEMMs"]
        assert gemms["ms"] > 0 and gemms["floor_ms"] > 0
        assert parts.get("norms, rotary, activations, adds")["floor_ms"] is None  # nothing of it in a floor
    # the patch count follows the images: a larger image has more, two images twice one
    patches = [s["patches"] for s in towers]
    assert patches[1] == 2 * patches[0] and patches[2] > patches[0] and patches[3] == 2 * patches[2]
    assert [s["tokens"] for s in prefills] == [24, 64]
    assert all(
        p["floor_ms"] > 0 for s in towers for p in s["parts"] if p["name"] in ("patch embed", "merger")
    )
    assert "| stage | ms | floor ms | stage / floor |" in done.stdout and "prefill, 64 tokens" in done.stdout


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v)
        return torch.relu(self.proj(o.transpose(1, 2).reshape(-1, 8)))


def test_the_recorder_replays_what_ran_with_the_same_shapes():
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ModuleList([_Block(), _Block()]))
    rec = Recorder()
    hook_linears(rec, model, lambda name: "embed" if name == "0" else "gemm")
    for block in blocks_of(model):
        rec.time_module(block, "blocks", replay=False)
    x = torch.randn(5, 3)
    with torch.no_grad(), rec.sdpa("attention"):
        h = model[0](x)
        for block in model[1]:
            h = block(h)
    rec.close()
    assert [part for part, _ in rec.calls] == ["embed"] + ["gemm", "attention", "gemm"] * 2
    assert set(rec.floor()) == {"embed", "gemm", "attention"}
    shapes = [tuple(args[0].shape) for _, _, args in rec._replays]
    assert shapes == [(5, 3)] + [(5, 8), (1, 2, 5, 4), (5, 8)] * 2
    assert rec.seconds["blocks"] >= rec.seconds["gemm"] + rec.seconds["attention"] > 0
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # put back
    model[0](x)  # the hooks are gone
    assert len(rec.calls) == 7
