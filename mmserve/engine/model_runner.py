"""Runs one packed forward of the language model over our KV pool.

A batch is a list of chunks `[start, end)` of requests' token sequences: prefill chunks (which may cut an
item's tokens anywhere) and decode tokens, packed into one `[1, total_tokens, hidden]` row. Input rows are
text embeddings with item rows spliced in (`splice_chunk`); positions are each request's precomputed prompt
positions (rows given by the family: 3 for M-RoPE) and `index + rope_delta` after the prompt. Items' extra
tensors (DeepStack levels) are sliced with the same rows and handed to the language model through the
family's `lm_inputs`. `lm_head` runs only on the last row of each chunk that reaches the end of its request's
known tokens (the rows that are sampled).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmserve.config import ModelConfig
from mmserve.engine.cache.kv_pool import KVPool
from mmserve.engine.cache.state_pool import StatePool
from mmserve.engine.cpu_kernels import kernels_for
from mmserve.engine.fused_layers import DecodeStack, FusedDecoderLayer, fuse_decoder_layers
from mmserve.engine.layers import check_runnable
from mmserve.engine.layers.attention import register_attention
from mmserve.engine.layers.attention_metadata import AttentionPlan
from mmserve.engine.layers.linear_state import StateMetadata, StateSegment, wrap_linear_layers
from mmserve.engine.packed_linear import PackedLinear, can_pack, pack_linears
from mmserve.engine.request import Request
from mmserve.glibc_heap import release_freed_memory
from mmserve.models.family import ModelFamily
from mmserve.models.loader import parse_dtype
from mmserve.models.weights import own_checkpoint_memory
from mmserve.multimodal.embedding import ChunkExtras, splice_chunk
from mmserve.quant.linear import attach_kernels, has_quantized
from mmserve.quant.quantize import quantize_head, quantize_linears


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # compute tokens [start, end) of request.token_ids
    end: int
    # hybrid models: (position p, state slot) for the state after token p - 1, taken inside this chunk
    checkpoints: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def samples(self) -> bool:
        return self.end == len(self.request.token_ids) and not self.request.prefill_only


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # (num_sampling_chunks, vocab) in the model's dtype, in chunk order
    prompt_logits: dict[int, torch.Tensor]  # chunk index -> (rows, vocab) predicting its next prompt tokens


class ModelRunner:
    """Owns the language model (never a tower) and runs packed forwards over the KV pool."""

    def __init__(
        self,
        family: ModelFamily,
        model_config: ModelConfig,
        dtype: str = "float32",
        device: str = "cpu",
        pack_weights: bool = True,
        fuse_layers: bool = True,
        cpu_kernels: bool = True,
        fp32_gemm: str = "auto",
        quantization: str | None = None,
        quantize_lm_head: bool = True,
    ) -> None:
        check_runnable(family.layer_specs)  # a layer kind the engine cannot run is refused, never approximated
        lm = family.load_language_model(parse_dtype(dtype), register_attention())
        self.family = family
        self.config = model_config
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        self.language_model = lm.model.to(self.device)
        self.embed_tokens = self.language_model.get_input_embeddings()
        self.lm_head = lm.lm_head.to(self.device)
        self.linear_layers = wrap_linear_layers(self.language_model, family.layer_specs)
        if quantization is not None:
            # weight-only, before fusion: every code and scale is per output row, so q/k/v (gate/up) quantized
            # one by one and then concatenated are the codes of the fused layer, and the model-dtype copies that
            # fusion would make of a 7B model's q/k/v and gate/up (~8 GB) are never made
            if has_quantized(self.language_model):
                raise ValueError(
                    f"{model_config.model_path}: the checkpoint is already quantized; --quantization {quantization} "
                    "applies to bf16/fp32 checkpoints"
                )
            quantize_linears(self.language_model, quantization, self.dtype)
            if quantize_lm_head:
                self.lm_head = quantize_head(self.lm_head, quantization, self.dtype)
        self.fused_layers = fuse_decoder_layers(self.language_model, family.layer_specs) if fuse_layers else 0
        self.kernels = kernels_for(self.device, self.dtype, cpu_kernels)  # None: the eager ops
        attach_kernels(self.language_model, self.kernels)  # quantized layers: a checkpoint's, or those just made
        attach_kernels(self.lm_head, self.kernels)
        self.packed = pack_weights and can_pack(self.dtype, self.device, fp32_gemm)
        if self.packed:  # oneDNN's layout once, not on every call (bf16: bitwise the same outputs)
            pack_linears(self.language_model)
            if type(self.lm_head) is torch.nn.Linear:
                self.lm_head = PackedLinear(self.lm_head)
        # Pure decode steps run every layer in one op when all are fused, over the weights in their final form.
        layers = getattr(self.language_model, "layers", [])
        all_qwen2 = bool(layers) and all(isinstance(m, FusedDecoderLayer) for m in layers)
        all_qwen2 = all_qwen2 and DecodeStack.stackable(layers)
        fused_kernels = all_qwen2 and self.kernels is not None
        self.decode_stack = DecodeStack(self.language_model, self.kernels) if fused_kernels else None
        self.attention = AttentionPlan(family.layer_specs)
        self.softcap = family.logit_softcap  # tanh(logits / cap) * cap after lm_head, as transformers does
        self._caches: tuple[tuple[int, int], tuple[list, list]] | None = None
        # the checkpoint's file mapping let go (what quantization replaced in it is never copied), and what
        # fusion, quantization and packing replaced given back to the OS
        own_checkpoint_memory(self.language_model)
        own_checkpoint_memory(self.lm_head)
        release_freed_memory()

    @staticmethod
    def _segment(chunk: ScheduledChunk, row: int) -> StateSegment:
        _check_state(chunk)
        cuts = [(p - chunk.start, slot) for p, slot in chunk.checkpoints]
        return StateSegment(row, chunk.num_tokens, chunk.request.state_slot, chunk.start == 0, cuts)

    def positions(self, request: Request, start: int, end: int) -> torch.Tensor:
        """Position ids (rows, n) of tokens [start, end)."""
        parts = []
        prompt_len = request.prompt_len
        rows = self.family.position_rows
        if start < prompt_len:
            parts.append(request.positions[:, start : min(end, prompt_len)])
        if end > prompt_len:
            tail = torch.arange(max(start, prompt_len), end) + request.rope_delta
            parts.append(tail.expand(rows, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def _layer_caches(self, pool: KVPool, window_pool: KVPool | None) -> tuple[list, list]:
        """Per layer, its K and V cache, from whichever pool holds the layer (built once per pair of pools)."""
        key = (id(pool), id(window_pool))
        if self._caches is None or self._caches[0] != key:
            if window_pool is None:
                caches = (pool.k_cache, pool.v_cache)
            else:  # each layer's rows are in exactly one of the two pools (None in the other)
                k, v = _either(pool.k_cache, window_pool.k_cache), _either(pool.v_cache, window_pool.v_cache)
                caches = (k, v)
            self._caches = (key, caches)
        return self._caches[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over rows of the final hidden state, soft-capped where the family's model caps them."""
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def forward(
        self,
        chunks: list[ScheduledChunk],
        pool: KVPool,
        states: StatePool | None = None,
        window_pool: KVPool | None = None,
    ) -> ForwardOutput:
        """KV of every chunk token is written to the pools (sliding-window layers' to `window_pool`), and the linear
        layers' state of each request advanced in `states` (checkpoints copied where the chunks ask); returns the
        logits (num_sampling_chunks, vocab) of the sampled rows (model dtype: the sampler casts only what it
        must), and the logits of the prompt rows of requests that want `prompt_logprobs`.

        Rows: prompt chunks first, in order, then every output token being decoded, as one block built with
        a few batched ops (per-request Python on a decode step is one slice of its slot buffer)."""
        decodes = [i for i, c in enumerate(chunks) if c.num_tokens == 1 and c.start >= c.request.prompt_len]
        is_decode = set(decodes)
        embeds, positions, token_ids, prefills = [], [], [], []
        first_row: dict[int, int] = {}  # chunk index -> its first row
        # (chunk index, first row, rows) predicting prompt tokens
        prompt_rows: list[tuple[int, int, int]] = []
        extra_positions: list[torch.Tensor] = []
        extra_rows: dict[str, list[torch.Tensor]] = {}
        segments: list[StateSegment] = []
        row = 0
        for i, chunk in enumerate(chunks):
            if i in is_decode:
                continue
            req, n = chunk.request, chunk.num_tokens
            if states is not None:
                segments.append(self._segment(chunk, row))
            ids = torch.tensor(req.token_ids[chunk.start : chunk.end], dtype=torch.int64, device=self.device)
            if self.family.remaps_ids:
                ids = self.family.embed_ids(ids)
            token_ids.append(ids)
            extras = ChunkExtras() if self.family.extra_dims else None
            embeds.append(splice_chunk(ids, chunk.start, self.embed_tokens, req.embeddings, extras))
            if extras is not None and extras.positions:
                extra_positions += [p + row for p in extras.positions]
                for name, parts in extras.rows.items():
                    extra_rows.setdefault(name, []).extend(parts)
            positions.append(self.positions(req, chunk.start, chunk.end))
            prefills.append((row, req, chunk.start, chunk.end))
            if req.params.prompt_logprobs is not None and chunk.start < req.prompt_len - 1:
                # row j predicts token start + j + 1: the rows up to the prompt's second-to-last token
                prompt_rows.append((i, row, min(chunk.end, req.prompt_len - 1) - chunk.start))
            first_row[i] = row
            row += n
        decoding = []
        if decodes:
            reqs = [chunks[i].request for i in decodes]
            steps = [chunks[i].start for i in decodes]
            ids = torch.tensor([r.token_ids[s] for r, s in zip(reqs, steps, strict=True)], dtype=torch.int64)
            ids = self.family.embed_ids(ids.to(self.device)) if self.family.remaps_ids else ids.to(self.device)
            token_ids.append(ids)
            embeds.append(self.embed_tokens(ids))
            tail = torch.tensor([s + r.rope_delta for r, s in zip(reqs, steps, strict=True)])
            positions.append(tail.expand(self.family.position_rows, -1))
            for j, (i, req, s) in enumerate(zip(decodes, reqs, steps, strict=True)):
                first_row[i] = row + j
                decoding.append((row + j, req, s))
            row += len(decodes)
        caches = self._layer_caches(pool, window_pool)
        meta = self.attention.metadata(caches, prefills, decoding, self.device, self.kernels)
        if states is not None:
            meta.state = StateMetadata(states, segments)
            if decodes:
                reqs = [chunks[i].request for i in decodes]
                for i in decodes:
                    _check_state(chunks[i])
                meta.state.decode_rows = slice(row - len(decodes), row)
                meta.state.decode_slots = torch.tensor([r.state_slot for r in reqs], device=self.device)
        inputs = torch.cat(embeds).unsqueeze(0).to(self.device, self.dtype)  # (1, T, hidden)
        pos = torch.cat(positions, dim=1).to(self.device)  # (rows, T)
        # HF text models take (batch, T) for plain RoPE and (3, batch, T) for M-RoPE.
        pos = pos.unsqueeze(1) if self.family.position_rows > 1 else pos
        kwargs = self.family.token_inputs(self.language_model, torch.cat(token_ids).unsqueeze(0))
        if extra_positions:
            where = torch.cat(extra_positions).to(self.device)
            rows = {k: torch.cat(v).to(self.device, self.dtype) for k, v in extra_rows.items()}
            kwargs.update(self.family.lm_inputs(row, where, rows))
        stack = self.decode_stack
        if stack is not None and meta.decode is not None and not meta.seqs and stack.takes(inputs.shape[1]):
            last = stack(inputs, pos, meta)[0]  # a pure decode step
        else:
            hidden = self.language_model(
                inputs_embeds=inputs, position_ids=pos, use_cache=False, mm_attn=meta, **kwargs
            )
            last = hidden.last_hidden_state[0]
        prompt_logits = {i: self.logits(last[r : r + n]).float() for i, r, n in prompt_rows}
        sample_rows = [first_row[i] + c.num_tokens - 1 for i, c in enumerate(chunks) if c.samples]
        if sample_rows == list(range(row - len(sample_rows), row)):  # a slice, not a gather copy
            picked = last[row - len(sample_rows) :]
        else:
            picked = last[sample_rows]
        return ForwardOutput(self.logits(picked), prompt_logits)


def _either(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [x if x is not None else y for x, y in zip(a, b, strict=True)]


def _check_state(chunk: ScheduledChunk) -> None:
    """A chunk must start where its request's state stands: anything else is a bookkeeping bug that would give
    wrong tokens silently."""
    req = chunk.request
    if req.state_slot is None or req.state_pos != chunk.start:
        raise RuntimeError(
            f"request {req.request_id}: its linear-attention state stands at {req.state_pos}, "
            f"the chunk starts at {chunk.start}"
        )
