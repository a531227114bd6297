"""The layer kinds the engine runs, one module each: `attention` (attention over the KV pools: causal, within a
sliding window, both ways inside an item's tokens, or over another layer's rows) and `linear_state` (Gated
DeltaNet over the state pool). `check_runnable` refuses, at load, any layer a family declares
(`mmserve.models.layer_specs`) that none of them runs exactly."""

from __future__ import annotations

from mmserve.models.layer_specs import AttentionSpec, LayerSpec, LinearStateSpec

# The transformers classes whose forward `linear_state.PoolLinearAttention` runs over a state slot (they read and
# write their state through the Cache methods it implements).
LINEAR_ATTENTION_CLASSES = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})


class UnsupportedLayerKind(ValueError):
    """A checkpoint has a decoder layer of a kind this engine does not run."""


def runnable(spec: LayerSpec) -> bool:
    if isinstance(spec, AttentionSpec):
        return spec.window is None or spec.window >= 1
    if isinstance(spec, LinearStateSpec):
        return spec.module_class in LINEAR_ATTENTION_CLASSES
    return False


def check_runnable(specs: tuple[LayerSpec, ...]) -> None:
    """Raise UnsupportedLayerKind (one line, naming the first layer kind and where it occurs) unless the engine
    runs every layer of `specs` exactly: every kind known, at most one sliding-window size (its layers share one
    pool), a layer that reads another's K/V reading an earlier layer of the same kind that writes them, and no
    sliding window beside linear-attention state (no such model, and their prefix caches differ)."""
    bad = [(i, spec) for i, spec in enumerate(specs) if not runnable(spec)]
    if bad:
        i, spec = bad[0]
        where = [j for j, s in bad if s == spec]
        raise UnsupportedLayerKind(
            f"decoder layer {i} is {spec.describe()}, a layer kind mmserve's engine does not run "
            f"(layers {where[:8]}{' ...' if len(where) > 8 else ''} of {len(specs)}); refusing to load the model "
            "rather than run it approximately"
        )
    attention = {i: s for i, s in enumerate(specs) if isinstance(s, AttentionSpec)}
    windows = sorted({s.window for s in attention.values() if s.window is not None})
    if len(windows) > 1:
        raise UnsupportedLayerKind(
            f"the model's sliding layers use {len(windows)} window sizes {windows}; mmserve's engine runs one"
        )
    if windows and any(isinstance(s, LinearStateSpec) for s in specs):
        raise UnsupportedLayerKind(
            "the model has both sliding-window and linear-attention layers; "
            "mmserve's engine runs one or the other"
        )
    for i, spec in attention.items():
        if spec.kv_source is None:
            continue
        source = attention.get(spec.kv_source)
        if (
            source is None
            or spec.kv_source >= i
            or not source.has_kv
            or (source.window, source.row_shape) != (spec.window, spec.row_shape)
        ):
            raise UnsupportedLayerKind(
                f"decoder layer {i} reads the K/V of layer {spec.kv_source}, which is not an earlier attention "
                "layer of its kind that writes them"
            )
