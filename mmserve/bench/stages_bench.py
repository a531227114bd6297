"""`mmserve bench stages`: the tower and a prefill chunk, part by part, against their floors (bench.stage_profile).

For each image configuration (size x images per request) the tower runs one request's images as the encoder
runs them (one batch through the family's `encode`), and the embeddings go through the wire codec and back
(the hand-off to the engine, without a socket); for each prefill length the engine runs one step over a fresh
prompt of that many tokens. Each is repeated `rounds` times with its floor replayed right after it (this
machine's speed drifts over minutes), and the report gives medians.
"""

from __future__ import annotations

import contextlib
import time

import torch

from mmserve.bench.engine_bench import make_image
from mmserve.bench.stage_profile import Part, Recorder, StageCost, blocks_of, hook_linears, median_ms
from mmserve.multimodal.items import MAIN, Modality
from mmserve.sampling_params import SamplingParams

PATCH_NAMES = ("patch_embed", "embeddings", "patch_embedder")
MERGER_NAMES = ("merger", "projector", "connector")


def _tower_part(name: str) -> str:
    if any(n in name for n in PATCH_NAMES):
        return "patch embed GEMM"
    if any(n in name for n in MERGER_NAMES):
        return "merger GEMM"
    return "tower GEMMs"


def _medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in rounds for k in r}
    return {k: median_ms([r.get(k, 0.0) for r in rounds]) for k in keys}


def tower_stage(encoder, images, rounds: int) -> StageCost:
    """One request's images through the encoder's tower (warmed first), and its hand-off."""
    from mmserve.transport.embedding_wire import EmbeddingItem, decode_part, encode_part

    family, tower = encoder.family, encoder.tower
    batch = [family.process(Modality.IMAGE, im, {}) for im in images]
    rec = Recorder()
    hook_linears(rec, tower, _tower_part)
    for name, child in tower.named_children():
        if any(n in name for n in PATCH_NAMES):
            rec.time_module(child, "patch embed", replay=False)
        elif any(n in name for n in MERGER_NAMES):
            for m in child if isinstance(child, torch.nn.ModuleList) else [child]:
                rec.time_module(m, "merger", replay=False)
    for block in blocks_of(tower):
        rec.time_module(block, "blocks", replay=False)
    measured, floors, tokens = [], [], 0
    try:
        with torch.no_grad(), rec.sdpa("attention"):
            for r in range(rounds + 1):
                rec.recording = r > 0  # the first run warms the kernels' caches
                rec.keep_calls = r == 1  # the first recorded round's calls are the replay
                rec.seconds.clear()
                start = time.perf_counter()
                out = family.encode(tower, batch)
                total = time.perf_counter() - start
                items = [
                    EmbeddingItem(i, _item(family, b, o))
                    for i, (b, o) in enumerate(zip(batch, out, strict=True))
                ]
                start = time.perf_counter()
                decode_part(encode_part("bench", 0, 1, "bench", items), copy=True)
                handoff = time.perf_counter() - start
                if r == 0:
                    continue
                tokens = sum(o[MAIN].shape[0] for o in out)
                measured.append({**rec.seconds, "total": total, "hand-off": handoff})
                floors.append(rec.floor())
    finally:
        rec.close()
    m, f = _medians(measured), _medians(floors)
    attention = m.get("attention", 0.0)
    tower_gemm = m.get("tower GEMMs", 0.0)
    parts = [
        Part("patch embed", m.get("patch embed", 0.0), f.get("patch embed GEMM", 0.0)),
        Part("tower GEMMs", tower_gemm, f.get("tower GEMMs", 0.0)),
        Part("tower attention (SDPA)", attention, f.get("attention", 0.0)),
        Part("norms, rotary, activations, adds", max(0.0, m.get("blocks", 0.0) - tower_gemm - attention)),
        Part("merger", m.get("merger", 0.0), f.get("merger GEMM", 0.0)),
    ]
    inside = sum(p.ms for p in parts)
    parts.append(Part("rotary tables, cu_seqlens, outputs", max(0.0, m["total"] - inside)))
    parts.append(Part("hand-off (wire encode + decode)", m["hand-off"]))
    patches = sum(b.tensors["pixel_values"].shape[0] for b in batch if "pixel_values" in b.tensors)
    sizes = sorted({f"{im.width}x{im.height}" for im in images})
    stage = f"tower, {len(images)} x {','.join(sizes)} ({patches} patches, {tokens} tokens)"
    floor = sum(p.floor_ms or 0.0 for p in parts)
    return StageCost(stage, parts, m["total"] + m["hand-off"], floor, {"patches": patches, "tokens": tokens})


def _item(family, tower_input, tensors):
    from mmserve.multimodal.items import ItemEmbedding
    from mmserve.transport.embedding_wire import HASH_BYTES

    return ItemEmbedding(Modality.IMAGE, b"\0" * HASH_BYTES, tensors, tower_input.metadata)


@contextlib.contextmanager
def _timed_attend(rec: Recorder, part: str):
    """The pool attention (KV write, gather, SDPA) of every layer, timed into `part`."""
    from mmserve.engine import fused_layers
    from mmserve.engine.layers import attention

    real = attention.attend

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = real(*args, **kwargs)
        if rec.recording:
            rec.seconds[part] += time.perf_counter() - start
        return out

    fused_layers.attend = attention.attend = timed
    try:
        yield
    finally:
        fused_layers.attend = attention.attend = real


def prefill_stage(engine, tokenizer, tokens: int, rounds: int) -> StageCost:
    """One engine step over a fresh `tokens`-token prompt of words (its first output token sampled), with its
    parts. Each round's prompt starts differently: no prefix cache hit."""
    runner = engine.runner
    lm = runner.language_model
    rec = Recorder()
    hook_linears(rec, lm, lambda name: "LM GEMMs")
    rec.time_module(runner.lm_head, "lm_head", replay=True)
    for layer in blocks_of(lm):
        rec.time_module(layer, "layers", replay=False)
    real_forward = runner.forward

    def forward(*args, **kwargs):
        start = time.perf_counter()
        out = real_forward(*args, **kwargs)
        if rec.recording:
            rec.seconds["forward"] += time.perf_counter() - start
        return out

    runner.forward = forward
    measured, floors = [], []
    try:
        with rec.sdpa("SDPA"), _timed_attend(rec, "attend"):
            for r in range(rounds + 1):
                rec.recording = r > 0
                rec.keep_calls = r == 1
                rec.seconds.clear()
                ids = _prompt(tokenizer, tokens, f"{time.monotonic_ns()}")
                engine.add_request(f"bench-stage-{time.monotonic_ns()}", ids, _one_token(), [])
                start = time.perf_counter()
                engine.step()
                total = time.perf_counter() - start
                while engine.has_work:
                    engine.step()
                if r == 0:
                    continue
                measured.append({**rec.seconds, "total": total})
                floors.append(rec.floor())
    finally:
        runner.forward = real_forward
        rec.close()
    m, f = _medians(measured), _medians(floors)
    gemm, sdpa, attend = m.get("LM GEMMs", 0.0), m.get("SDPA", 0.0), m.get("attend", 0.0)
    parts = [
        Part("LM GEMMs", gemm, f.get("LM GEMMs", 0.0)),
        Part("prefill attention (SDPA)", sdpa, f.get("SDPA", 0.0)),
        Part("KV write + gather", max(0.0, attend - sdpa)),
        Part("norms, rotary, activations, adds", max(0.0, m.get("layers", 0.0) - gemm - attend)),
        Part("lm_head (sampled rows)", m.get("lm_head", 0.0), f.get("lm_head", 0.0)),
        Part(
            "embed, splice, metadata, final norm",
            max(0.0, m.get("forward", 0.0) - m.get("layers", 0.0) - m.get("lm_head", 0.0)),
        ),
        Part("scheduler, sampler, outputs", max(0.0, m["total"] - m.get("forward", 0.0))),
    ]
    floor = sum(p.floor_ms or 0.0 for p in parts)
    return StageCost(f"prefill, {tokens} tokens", parts, m["total"], floor, {"tokens": tokens})


def _prompt(tokenizer, tokens: int, seed: str) -> list[int]:
    """Exactly `tokens` ids of plain words, starting with `seed`."""
    ids: list[int] = []
    words = seed
    while len(ids) < tokens:
        ids += tokenizer(words, add_special_tokens=False)["input_ids"]
        words = " ".join(f"word{len(ids)}x{j}" for j in range(64))
    return ids[:tokens]


def _one_token() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def run(
    model: str,
    dtype: str,
    image_sizes: list[tuple[int, int]],
    images_per_request: list[int],
    prefill_tokens: list[int],
    rounds: int,
    **options,
) -> list[StageCost]:
    from mmserve.llm import LLM

    longest = max(prefill_tokens, default=1)
    options.setdefault("max_num_batched_tokens", max(longest, 2048))  # each prefill in one chunk unless told
    llm = LLM(model, dtype=dtype, max_num_seqs=4, **options)
    costs = []
    seed = 1000
    for size in image_sizes:
        for count in images_per_request:
            images = [make_image(seed + i, size) for i in range(count)]
            seed += count
            costs.append(tower_stage(llm.encoder, images, rounds))
            print(report([costs[-1]]), flush=True)
    for tokens in prefill_tokens:
        costs.append(prefill_stage(llm.engine, llm.tokenizer, tokens, rounds))
        print(report([costs[-1]]), flush=True)
    return costs


def report(costs: list[StageCost]) -> str:
    lines = []
    for cost in costs:
        lines += [
            f"\n{cost.stage}: {cost.total_ms:.1f} ms, floor {cost.floor_ms:.1f} ms, {cost.over_floor:.2f}x",
            "| part | ms | floor ms | part / floor |",
            "|---|---|---|---|",
        ]
        for p in cost.parts:
            floor = f"{p.floor_ms:.1f}" if p.floor_ms is not None else "-"
            ratio = f"{p.ratio:.2f}x" if p.ratio is not None else "-"
            lines.append(f"| {p.name} | {p.ms:.1f} | {floor} | {ratio} |")
        lines.append(
            f"| **total** | **{cost.total_ms:.1f}** | **{cost.floor_ms:.1f}** | **{cost.over_floor:.2f}x** |"
        )
    return "\n".join(lines)


def summary(costs: list[StageCost]) -> str:
    """One line per stage: total, floor, ratio, and the cost per patch (towers) or per token."""
    lines = [
        "| stage | ms | floor ms | stage / floor | ms per 1k patches or tokens |",
        "|---|---|---|---|---|",
    ]
    for c in costs:
        per = c.detail.get("patches") or c.detail.get("tokens") or 1
        lines.append(
            f"| {c.stage} | {c.total_ms:.1f} | {c.floor_ms:.1f} | {c.over_floor:.2f}x | {c.total_ms / per * 1e3:.1f} |"
        )
    return "\n".join(lines)
