"""`mmserve demo`: the whole multimodal core on the embedded tiny model, checked against HF `generate`.

Builds the tiny checkpoint if needed, sends one generated image through media loading (data URI), content
hashing, preprocessing, the vision tower, the embedding cache, placeholder expansion, M-RoPE positions
and chunked embedding splice, then decodes greedily from the spliced embeddings and compares the tokens
with HF `generate` on the raw inputs.
"""

from __future__ import annotations

import base64
import io
import os
import time

import torch
from PIL import Image, ImageDraw

from mmserve.config import MediaConfig
from mmserve.models.loader import load_model, load_processor, load_tokenizer
from mmserve.multimodal.cache import EmbeddingCache
from mmserve.multimodal.embedding import PlacedEmbedding, splice_chunk
from mmserve.multimodal.items import Modality, MultimodalItem, content_hash
from mmserve.multimodal.media import MediaRef, decode_image
from mmserve.multimodal.media_fetch import load_bytes
from mmserve.testing.reference import hf_generate
from mmserve.testing.tiny_models import ensure_tiny_model

DEFAULT_MODEL_DIR = os.path.join("models", "tiny-qwen2-vl")


def demo_image() -> bytes:
    img = Image.new("RGB", (96, 64), (30, 60, 200))
    ImageDraw.Draw(img).rectangle((20, 12, 60, 50), fill=(220, 40, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def greedy_decode(
    model, inputs_embeds: torch.Tensor, positions: torch.Tensor, rope_delta: int, steps: int
) -> list[int]:
    """Prefill `inputs_embeds` (L, hidden) at M-RoPE `positions` (3, L), then decode greedily.

    Decode position of sequence index i >= L is i + rope_delta on all three axes.
    """
    from transformers import DynamicCache

    lm, cache, tokens = model.model.language_model, DynamicCache(config=model.config), []
    embeds, pos = inputs_embeds.unsqueeze(0), positions.unsqueeze(1)  # (1, L, hidden), (3, 1, L)
    for _ in range(steps):
        hidden = lm(inputs_embeds=embeds, position_ids=pos, cache=cache, use_cache=True).last_hidden_state
        token = int(model.lm_head(hidden[:, -1]).argmax(-1))
        tokens.append(token)
        index = cache.get_seq_length()
        embeds = lm.get_input_embeddings()(torch.tensor([[token]]))
        pos = torch.full((3, 1, 1), index + rope_delta)
    return tokens


def run_demo(model_dir: str = DEFAULT_MODEL_DIR, max_new_tokens: int = 12, chunk_tokens: int = 16) -> bool:
    t0 = time.perf_counter()
    ensure_tiny_model(model_dir)
    model, tok, proc = load_model(model_dir), load_tokenizer(model_dir), load_processor(model_dir)
    print(f"model  {model_dir} ({model.config.model_type}) ready in {time.perf_counter() - t0:.2f}s")

    uri = "data:image/png;base64," + base64.b64encode(demo_image()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "Describe the image."}]}]  # fmt: skip
    t1 = time.perf_counter()
    data = load_bytes(MediaRef.parse(uri), MediaConfig())
    digest = content_hash(Modality.IMAGE, data, proc.hash_settings(Modality.IMAGE))
    processed = proc.process(Modality.IMAGE, decode_image(data, MediaConfig()))
    cache = EmbeddingCache(capacity_mb=64)

    def encode() -> torch.Tensor:
        with torch.no_grad():
            grid = torch.tensor([processed.grid_thw])
            return model.model.get_image_features(processed.pixel_values, grid).pooler_output[0]

    embedding = cache.get_or_compute(digest, encode)
    t2 = time.perf_counter()

    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    item = MultimodalItem(Modality.IMAGE, digest, processed.num_tokens, processed.grid_thw)
    prompt = proc.expand(tok(text, add_special_tokens=False)["input_ids"], [item])
    positions, rope_delta = proc.positions(prompt)
    ids = torch.tensor(prompt.token_ids)
    embed = model.model.language_model.get_input_embeddings()
    placed = [PlacedEmbedding(item.offset, embedding)]
    with torch.no_grad():
        chunks = [
            splice_chunk(ids[s : s + chunk_tokens], s, embed, placed)
            for s in range(0, len(ids), chunk_tokens)
        ]
        tokens = greedy_decode(model, torch.cat(chunks), positions, rope_delta, max_new_tokens)
    t3 = time.perf_counter()
    reference = hf_generate(model, prompt, [processed], max_new_tokens=max_new_tokens).token_ids

    print(f"image  {item.hash_hex[:16]}… grid {processed.grid_thw} -> {item.num_tokens} tokens at "
          f"[{item.offset}, {item.end}), pad value {item.pad_value}")  # fmt: skip
    print(
        f"prompt {len(prompt.token_ids)} tokens, rope delta {rope_delta}, spliced in chunks of {chunk_tokens}"
    )
    print(f"answer {tok.decode(tokens)!r}")
    print(f"tokens {tokens}")
    print(f"timing encode {1000 * (t2 - t1):.1f} ms, generate {1000 * (t3 - t2):.1f} ms")
    same = tokens == reference
    print(f"parity with HF generate: {'identical' if same else 'DIFFERENT: ' + str(reference)}")
    return same
