"""mmserve's CPU kernels (mmserve.engine.cpu_kernels): each op against the eager ops it replaces, and the engine
with them against the engine without them (same greedy tokens, logits within float rounding), for every
family, fused layers and HF's. The parity suites (HF `generate` in every mode) run with the kernels on, the
default. The kernels are built here if this machine has not built them yet: set-up needs g++."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmserve.cli_args import engine_config_from_args
from mmserve.cpu_info import cpu_flags
from mmserve.engine.cache.kv_dtype import from_cache, to_cache
from mmserve.engine.cpu_kernels import kernels_for
from mmserve.engine.fused_layers import rms_norm
from mmserve.engine.layers.attention import AttentionMetadata, DecodeGroup, SeqAttention, _decode_attention
from tests.families import FAMILIES
from tests.test_engine_parity import make_llm
from tests.test_fused_layers import batch
from tests.test_packed_linear import logits_of

DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_norms_match_the_eager_ops(kernels, dtype, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * 896, dtype=dtype)[:, :896] * 3  # rows with a stride wider than a row
    delta = torch.randn(rows, 896, dtype=dtype)
    weight = torch.randn(896, dtype=dtype)
    total, normed = kernels.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)  # the residual add rounds as the eager add
    exact = dtype == torch.bfloat16  # fp32: the sum of squares adds in another order (last bits)
    pairs = [(kernels.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))]
    pairs.append((normed, rms_norm(x + delta, weight, 1e-6)))
    for got, want in pairs:
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
def test_rope_is_the_eager_rope_bitwise(kernels, dtype, dim):
    torch.manual_seed(dim)
    rows, heads, kv_heads = 9, 6, 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    cos, sin = torch.randn(rows, dim, dtype=dtype), torch.randn(rows, dim, dtype=dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    want = qk * cos.unsqueeze(1) + qk.roll(dim // 2, -1) * sin.unsqueeze(1)
    values = qkv[:, (heads + kv_heads) * dim :].clone()
    kernels.rope_(qk, cos, sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], values)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_silu_mul_matches_the_eager_ops(kernels, dtype, rows):
    torch.manual_seed(rows)
    width = 1000  # not a multiple of the kernel's 512-element blocks
    gate_up = (torch.randn(rows, 2 * width + 6) * 4).to(dtype)[:, : 2 * width]  # a wider row stride
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    got = kernels.silu_mul(gate_up)
    assert got.shape == want.shape and got.is_contiguous()
    # its exp is within about an ulp of PyTorch's: fp32 in the last bits, bf16 at most one step apart
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)


def test_silu_mul_over_every_bf16_gate_value(kernels):
    """Every bf16 bit pattern as a gate (infinities and NaNs too), up = 1 and up = -3: on AVX-512 the kernel's
    bf16 silu is a table of torch's silu over the 65,536 values, so it is the eager ops' bits; elsewhere its
    own exp is within a step of torch's."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(64, 1024)
    for u in (1.0, -3.0):
        gate_up = torch.cat([gate, torch.full_like(gate, u)], dim=1)
        want = F.silu(gate) * u
        got = kernels.silu_mul(gate_up)
        if "avx512f" in cpu_flags():
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
        else:
            small = gate.float().abs() < 80  # its exp saturates past 88
            torch.testing.assert_close(got[small], want[small], rtol=2**-7, atol=1e-3)


def decode_case(dtype, batch, heads, kv_heads, dim, seed, runs=False):
    """A pool, requests of different lengths on scattered slots, their query rows among prefill rows. With
    `runs`, each request's slots are a run (its prompt's) and then a few scattered ones (its decode tokens'),
    as an engine lays them out: the kernel reads whole blocks of a run in place."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = 600
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    order = torch.arange(num_slots) if runs else torch.randperm(num_slots, generator=gen)
    lengths = [1 + (37 * i + 11) % 90 for i in range(batch)]
    starts = [sum(lengths[:i]) for i in range(batch)]
    kv = [order[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    if runs:  # the last three slots of each request from the pool's far end
        far = torch.randperm(num_slots - sum(lengths), generator=gen) + sum(lengths)
        kv = [torch.cat([k[:-3], far[3 * i : 3 * i + 3]]) if len(k) > 3 else k for i, k in enumerate(kv)]
    rows = [3 + 2 * i for i in range(batch)]  # not consecutive: rows of other chunks between them
    query = torch.randn(rows[-1] + 2, heads + kv_heads, dim, generator=gen).to(dtype)[:, :heads]
    return query, k_cache, v_cache, DecodeGroup.make(rows, kv, torch.device("cpu"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,dim,runs",
    [
        (14, 2, 64, False),  # G = 7 (on AMX in bf16 where the CPU has it)
        (14, 2, 64, True),
        (12, 2, 128, False),  # G = 6
        (12, 2, 128, True),
        (4, 4, 64, False),  # G = 1 (MHA)
        (16, 1, 64, True),  # G = 16
        (6, 2, 80, False),  # any head size
        (8, 4, 256, True),  # Gemma 3's head size
        (8, 1, 512, False),  # Gemma 4's full layers'
    ],
)
def test_decode_attention_matches_sdpa(kernels, dtype, heads, kv_heads, dim, runs):
    query, k_cache, v_cache, group = decode_case(dtype, 6, heads, kv_heads, dim, seed=heads + dim, runs=runs)
    want = _decode_attention(query, k_cache, v_cache, group, 0.1)[:, :, 0]  # SDPA over gathered K/V
    out = torch.full_like(query, 7.0)
    kernels.decode_attention_(out, query, group.row_ids, k_cache, v_cache, group.slots, group.lengths, 0.1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    torch.testing.assert_close(out[group.row_ids].float(), want.float(), **tol)
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[group.row_ids] = False
    assert torch.all(out[others] == 7.0)  # only the decode rows are written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stored", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,runs", [(14, 2, 64, True), (12, 2, 128, False), (6, 2, 80, False), (4, 4, 64, False)]
)
def test_decode_attention_reads_an_8bit_pool_as_its_widened_values(kernels, dtype, stored, heads, kv_heads, dim, runs):
    """An 8-bit pool (`--kv-cache-dtype`) gives exactly what a pool of the query's dtype holding the values
    kv_dtype.from_cache reads gives: each row is widened as it is loaded (fp8 exactly; int8 as code x its row's
    scale, rounded to the query's dtype), on the AMX tiles, the AVX-512 loops and the portable ones (a head size
    of 80; one query head per KV head) alike."""
    query, k_cache, v_cache, group = decode_case(dtype, 6, heads, kv_heads, dim, seed=dim, runs=runs)
    k8, v8 = (to_cache(c * 40, stored) for c in (k_cache, v_cache))  # * 40: past e4m3's 448, saturated
    assert k8.shape[-1] == dim + (4 if stored == torch.int8 else 0)  # an int8 row: codes, then its scale
    outs = []
    for k, v in ((k8, v8), (from_cache(k8, dtype), from_cache(v8, dtype))):
        out = torch.zeros_like(query)
        kernels.decode_attention_(out, query, group.row_ids, k, v, group.slots, group.lengths, 0.1)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.isfinite(outs[0]).all()


def test_int8_rows_round_trip_within_half_a_step():
    x = torch.randn(5, 3, 64) * torch.logspace(-3, 3, 5).view(5, 1, 1)
    x[0, 0] = 0.0  # a row of zeros: scale 0, codes 0, read back as zeros
    rows = to_cache(x, torch.int8)
    back = from_cache(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-6))
    assert torch.equal(back[0, 0], torch.zeros(64)) and rows[..., :64].abs().max() == 127


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_quantizes_int8_rows_as_to_cache_does(kernels, dtype):
    pool = torch.zeros(8, 2, 16 + 4, dtype=torch.int8)
    values = torch.zeros_like(pool)
    rows = (torch.randn(3, 2, 16) * torch.tensor([1e-3, 1.0, 300.0]).view(3, 1, 1)).to(dtype)
    rows[1, 1] = 0.0  # scale 0
    slots = torch.tensor([5, 1, 6])
    kernels.store_kv_(pool, values, slots, rows, rows * 2)
    assert torch.equal(pool[slots], to_cache(rows, torch.int8))  # codes and scale bytes, bit for bit
    assert torch.equal(values[slots], to_cache(rows * 2, torch.int8))
    with pytest.raises(RuntimeError, match="int8 pool"):
        kernels.store_kv_(pool, values, slots, to_cache(rows, torch.int8), to_cache(rows, torch.int8))


def test_store_kv_writes_fp8_rows_as_they_are(kernels):
    pool = torch.zeros(8, 2, 16, dtype=torch.float8_e4m3fn)
    values = torch.zeros_like(pool)
    rows = to_cache(torch.randn(3, 2, 16) * 300, torch.float8_e4m3fn)
    slots = torch.tensor([5, 1, 6])
    kernels.store_kv_(pool, values, slots, rows, rows)
    assert torch.equal(pool[slots].view(torch.uint8), rows.view(torch.uint8))
    assert pool.float().abs().max() <= 448


def test_decode_attention_refuses_bad_indices(kernels):
    query, k_cache, v_cache, group = decode_case(torch.float32, 2, 4, 2, 64, seed=1)
    out = torch.empty_like(query)
    bad = group.slots.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.decode_attention_(out, query, group.row_ids, k_cache, v_cache, bad, group.lengths, 0.1)
    with pytest.raises(RuntimeError, match="bad row or length"):
        rows = group.row_ids + query.shape[0]
        kernels.decode_attention_(out, query, rows, k_cache, v_cache, group.slots, group.lengths, 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_store_kv_writes_what_index_copy_writes(kernels, dtype, rows):
    torch.manual_seed(rows)
    k_cache, v_cache = (torch.randn(400, 2, 64, dtype=dtype) for _ in range(2))
    # key and value are strided views, as in a layer's q/k/v output
    qkv = torch.randn(rows, 18, 64, dtype=dtype)
    key, value = qkv[:, 14:16], qkv[:, 16:]
    slots = torch.randperm(400)[:rows]
    want_k, want_v = k_cache.clone().index_copy_(0, slots, key), v_cache.clone().index_copy_(0, slots, value)
    kernels.store_kv_(k_cache, v_cache, slots, key, value)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # and no other slot changed
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.store_kv_(k_cache, v_cache, torch.full((rows,), 400), key, value)
    with pytest.raises(RuntimeError, match="pool's row shape and dtype"):
        other = key.float() if dtype != torch.float32 else key.double()
        kernels.store_kv_(k_cache, v_cache, slots, other, value)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "llava_onevision", "qwen2_audio", "qwen3_vl"])
def test_engine_with_kernels_keeps_tokens(arch, tiny_model, kernels):
    """Chunked prefills beside decodes of different lengths, a prefix-cache hit; fp32."""
    spec, path = FAMILIES[arch], tiny_model(arch)
    options = dict(dtype="float32", max_num_batched_tokens=48)
    fast = make_llm(path, spec.mm_kwargs, **options)
    eager = make_llm(path, spec.mm_kwargs, cpu_kernels=False, **options)
    assert fast.engine.runner.kernels is not None and eager.engine.runner.kernels is None
    tokens, logits = logits_of(fast, batch(spec))
    eager_tokens, eager_logits = logits_of(eager, batch(spec))
    assert tokens == eager_tokens
    for a, b in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert fast.engine.scheduler.stats.prefix_hit_tokens > 0


def test_hf_layers_use_the_decode_kernel(tiny_qwen2_vl, kernels, monkeypatch):
    """Without the fused layers, transformers' layers call the pool attention, which runs the kernel."""
    calls = []
    real = kernels.decode_attention_
    monkeypatch.setattr(kernels, "decode_attention_", lambda *a: calls.append(1) or real(*a))
    spec = FAMILIES["qwen2_vl"]
    llm = make_llm(tiny_qwen2_vl, spec.mm_kwargs, fuse_layers=False)
    assert llm.engine.runner.kernels is kernels
    eager = make_llm(tiny_qwen2_vl, spec.mm_kwargs, fuse_layers=False, cpu_kernels=False)
    tokens, _ = logits_of(llm, batch(spec))
    assert calls
    assert tokens == logits_of(eager, batch(spec))[0]


def test_kernels_only_where_they_apply(kernels):
    cpu = torch.device("cpu")
    assert (
        kernels_for(cpu, torch.bfloat16, True) is kernels and kernels_for(cpu, torch.float32, True) is kernels
    )
    assert kernels_for(cpu, torch.float16, True) is None  # fp16 runs the eager ops
    assert kernels_for(torch.device("cuda"), torch.bfloat16, True) is None
    assert kernels_for(cpu, torch.bfloat16, False) is None


def test_disable_cpu_kernels_flag(tiny_qwen2_vl):
    from mmserve.cli import build_parser

    args = build_parser().parse_args(["serve", tiny_qwen2_vl])
    assert engine_config_from_args(args).cpu_kernels
    args = build_parser().parse_args(["serve", tiny_qwen2_vl, "--disable-cpu-kernels"])
    assert not engine_config_from_args(args).cpu_kernels


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_stack_is_the_layers_op_by_op_bitwise(kernels, tiny_qwen2_vl, dtype):
    """csrc/decode_layers.cpp against the same layers' kernels called one by one from Python (the path of steps
    with a prefill) and the model's final norm, on the tiny model's layers (their weights packed where the
    engine packs them): the same hidden states and the same K/V written to every layer's pool, bit for bit."""
    llm = make_llm(tiny_qwen2_vl, FAMILIES["qwen2_vl"].mm_kwargs, dtype=dtype)
    runner = llm.engine.runner
    text_model, stack = runner.language_model, runner.decode_stack
    assert stack is not None and stack.packed == runner.packed
    torch.manual_seed(3)
    lengths, hidden = [1, 7, 20, 33, 12], text_model.config.hidden_size
    slots = torch.randperm(200)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    seqs = [
        SeqAttention(row, 1, slots[s : s + n], None)
        for row, (s, n) in enumerate(zip(starts, lengths, strict=True))
    ]
    new_slots = torch.stack([seq.kv_slots[-1] for seq in seqs])
    x = torch.randn(1, len(lengths), hidden, dtype=runner.dtype)
    positions = (torch.arange(len(lengths)) + 40)[None, None, :].expand(3, 1, -1)
    layers = list(text_model.layers)
    pool_shape = (200, layers[0].num_kv_heads, layers[0].head_dim)
    pools = [torch.randn(pool_shape, dtype=runner.dtype) for _ in range(2 * len(layers))]

    def layer_by_layer(x, meta):
        rotary = text_model.rotary_emb(x, positions)
        for layer in layers:
            x = layer.layer_ops(x[0], meta, rotary).unsqueeze(0)
        return text_model.norm(x)

    outputs, written = [], []
    for run in (lambda x, meta: stack(x, positions, meta), layer_by_layer):
        k_cache, v_cache = [p.clone() for p in pools[::2]], [p.clone() for p in pools[1::2]]
        meta = AttentionMetadata.build(k_cache, v_cache, new_slots, seqs, "cpu", kernels)
        assert meta.decode is not None and not meta.seqs  # a pure decode step
        outputs.append(run(x, meta))
        written.append(k_cache + v_cache)
    assert torch.equal(outputs[0], outputs[1])
    assert all(torch.equal(a, b) for a, b in zip(*written, strict=True))
    assert not torch.equal(written[0][0], pools[0])  # the new K rows were written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 1000, 2 * 16384 + 3, 151936])
def test_greedy_argmax_is_torch_argmax(kernels, dtype, vocab):
    """Each row's first maximum, NaN counting as the maximum: torch.argmax's ids, over pieces of a row handled
    by different threads and blocks of a piece, ties across both."""
    torch.manual_seed(vocab)
    logits = torch.randn(6, vocab).to(dtype)
    top = logits.max().item() + 1
    logits[1, -1] = logits[1, vocab // 2] = top  # a tie across pieces: the earlier one
    logits[2] = 0.0  # all tied: id 0
    logits[3, vocab // 3] = logits[3, -1] = float("nan")  # the first NaN
    logits[4] = float("-inf")
    logits[5, :] = top
    logits[5, 0] = -1.0  # the maximum from id 1, in the first block
    logits[5, vocab - 1] = -0.0 if vocab > 1 else top
    got = kernels.greedy_argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
    strided = torch.randn(3, 2 * vocab).to(dtype)[:, :vocab]  # rows with a stride wider than a row
    assert torch.equal(kernels.greedy_argmax(strided), strided.argmax(-1))


def test_the_engine_samples_greedy_rows_with_the_kernel(tiny_qwen2_vl, kernels):
    llm = make_llm(tiny_qwen2_vl, FAMILIES["qwen2_vl"].mm_kwargs)
    assert llm.engine.sampler.argmax == kernels.greedy_argmax
    eager = make_llm(tiny_qwen2_vl, FAMILIES["qwen2_vl"].mm_kwargs, cpu_kernels=False)
    assert eager.engine.sampler.argmax is None


# -- Gated DeltaNet decode (Qwen3.5's linear-attention layers) ------------------------------------------------
def _gated_deltanet(head: int, dtype: torch.dtype):
    """One transformers Gated DeltaNet layer, with slow decays (so the state matters) and random weights."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(
        hidden_size=96,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=head,
        linear_value_head_dim=head,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(head)
    layer = Qwen3_5GatedDeltaNet(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.A_log.copy_(torch.empty(4).uniform_(0.02, 0.2).log())
    return layer.to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head", [128, 8])
def test_the_gated_deltanet_decode_kernel_is_transformers_step_in_place(kernels, dtype, head):
    """Four requests' one decode token through the in-pool fast path and through transformers' own forward on
    the gathered states: outputs and states bitwise equal at Qwen3.5's head size (128), within float rounding
    at a tiny one (8: torch sums that narrow a dimension in another order)."""
    from mmserve.engine.layers.linear_state import PoolLinearAttention, _SlotCache

    layer = _gated_deltanet(head, dtype)
    wrapped = PoolLinearAttention(layer)
    conv_dim = layer.conv_dim
    conv = torch.randn(6, conv_dim, 4).to(dtype)
    recurrent = torch.randn(6, 4, head, head) * 0.5
    slots = torch.tensor([4, 1, 5, 2])
    x = torch.randn(4, 1, 96).to(dtype)
    before_others = recurrent[[0, 3]].clone()
    cache = _SlotCache(conv.index_select(0, slots), recurrent.index_select(0, slots), fresh=False)
    with torch.no_grad():
        want = layer(x, cache=cache)
        got = wrapped._decode_in_pool(x, conv, recurrent, slots, kernels)
    pairs = [(got, want), (recurrent[slots], cache.recurrent), (conv[slots], cache.conv)]
    for g, w in pairs:
        if head == 128:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(recurrent[[0, 3]], before_others)  # the other slots are untouched
    q, k, v = (torch.randn(1, 4, head) for _ in range(3))
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.gated_delta_step_(recurrent, torch.tensor([6]), q, k, v, torch.rand(1, 4), torch.rand(1, 4))
