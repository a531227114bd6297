from __future__ import annotations

import pytest

from mmserve.multimodal.items import PAD_BASE, PAD_BITS, Modality, MultimodalItem, content_hash, pad_value


def test_hash_is_128_bit_and_depends_on_every_field():
    base = content_hash(Modality.IMAGE, b"abc", {"max_pixels": 100})
    assert len(base) == 16
    assert content_hash(Modality.IMAGE, b"abc", {"max_pixels": 100}) == base
    assert content_hash(Modality.VIDEO, b"abc", {"max_pixels": 100}) != base
    assert content_hash(Modality.IMAGE, b"abd", {"max_pixels": 100}) != base
    assert content_hash(Modality.IMAGE, b"abc", {"max_pixels": 101}) != base
    # length-prefixing: moving bytes between fields cannot collide
    assert content_hash(Modality.IMAGE, b"", {"a": 1}) != content_hash(Modality.IMAGE, b"{}", {})


def test_settings_order_does_not_matter():
    assert content_hash(Modality.IMAGE, b"x", {"a": 1, "b": 2}) == content_hash(
        Modality.IMAGE, b"x", {"b": 2, "a": 1}
    )


@pytest.mark.parametrize("seed", range(50))
def test_pad_values_above_vocab_and_in_int64(seed):
    digest = content_hash(Modality.IMAGE, seed.to_bytes(4, "little"), {})
    value = pad_value(digest)
    assert PAD_BASE <= value < 2**63
    assert value > 10**9  # above any real vocabulary
    assert PAD_BITS >= 60


def test_pad_value_keeps_61_bits_of_digest():
    # Two digests differing only in bit 60 must differ; bit 61 and up are dropped by design.
    a = bytes(16)
    b = (1 << 60).to_bytes(16, "little")
    assert pad_value(a) != pad_value(b)


def test_item_offsets_are_half_open():
    item = MultimodalItem(
        Modality.IMAGE, content_hash(Modality.IMAGE, b"x", {}), num_tokens=6, offset=10, span=6
    )
    assert (item.offset, item.end) == (10, 16)
    # A span may be longer than the item's rows when the family puts text inside it (Qwen3-VL timestamps).
    assert MultimodalItem(Modality.VIDEO, item.content_hash, num_tokens=6, offset=10, span=9).end == 19
    assert item.pad_value == pad_value(item.content_hash)


def test_same_bytes_hash_equal_across_data_uri_file_and_raw(tmp_path):
    import base64

    from mmserve.config import MediaConfig
    from mmserve.multimodal.media import MediaRef, load_bytes

    payload = b"\x89PNG\r\n\x1a\n pretend image bytes"
    (tmp_path / "a.png").write_bytes(payload)
    cfg = MediaConfig(allowed_local_media_path=str(tmp_path))
    refs = [
        MediaRef.parse("data:image/png;base64," + base64.b64encode(payload).decode()),
        MediaRef.parse(f"file://{tmp_path}/a.png"),
        MediaRef.from_bytes(payload),
    ]
    digests = {content_hash(Modality.IMAGE, load_bytes(ref, cfg), {"s": 1}) for ref in refs}
    assert len(digests) == 1
    assert len({ref.routing_key() for ref in (refs[0], refs[2])}) == 1
