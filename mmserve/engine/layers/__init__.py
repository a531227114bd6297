"""The layer kinds the engine runs, one module each: `attention` (causal attention over the KV pool) and
`linear_state` (Gated DeltaNet over the state pool). `check_runnable` refuses, at load, any layer a family
declares (`mmserve.models.layer_specs`) that none of them runs exactly."""

from __future__ import annotations

from mmserve.models.layer_specs import AttentionSpec, LayerSpec, LinearStateSpec

# The transformers classes whose forward `linear_state.PoolLinearAttention` runs over a state slot (they read and
# write their state through the Cache methods it implements).
LINEAR_ATTENTION_CLASSES = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})


class UnsupportedLayerKind(ValueError):
    """A checkpoint has a decoder layer of a kind this engine does not run."""


def runnable(spec: LayerSpec) -> bool:
    if isinstance(spec, AttentionSpec):
        return spec.window is None and not spec.bidirectional_items and spec.kv_source is None
    if isinstance(spec, LinearStateSpec):
        return spec.module_class in LINEAR_ATTENTION_CLASSES
    return False


def check_runnable(specs: tuple[LayerSpec, ...]) -> None:
    """Raise UnsupportedLayerKind (one line, naming the first layer kind and where it occurs) unless the engine
    runs every layer of `specs` exactly."""
    bad = [(i, spec) for i, spec in enumerate(specs) if not runnable(spec)]
    if bad:
        i, spec = bad[0]
        where = [j for j, s in bad if s == spec]
        raise UnsupportedLayerKind(
            f"decoder layer {i} is {spec.describe()}, a layer kind mmserve's engine does not run "
            f"(layers {where[:8]}{' ...' if len(where) > 8 else ''} of {len(specs)}); refusing to load the model "
            "rather than run it approximately"
        )
