"""What each decoder layer of a language model keeps per token or per request: the seam between a family and the
engine's pools, scheduler, prefix cache, kernels and P/D layout.

A family declares one spec per decoder layer (`ModelFamily.layer_specs`), read from transformers' `layer_types`
by `layer_specs_from_hf` for the families that follow its conventions:
- `AttentionSpec`: the layer writes one K and one V row per token (its KV heads and head size), attends causally,
  optionally within a sliding window, optionally both ways inside an item's tokens, or reads another layer's rows
  instead of writing its own (`kv_source`);
- `LinearStateSpec`: the layer keeps a fixed-size state per request instead of rows: a causal-conv window (conv
  dim x kernel columns, in the model's dtype, as transformers keeps it) and a recurrent matrix per value head
  (float32 in every model dtype, as transformers keeps it).

The engine runs only the kinds `mmserve.engine.layers.check_runnable` accepts; any other is refused at load,
naming it, and never run approximately.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSpec:
    num_kv_heads: int
    head_dim: int
    window: int | None = None  # transformers' sliding window: key j visible to query i iff j > i - window
    bidirectional_items: bool = False  # an item's tokens see each other both ways (Gemma)
    kv_source: int | None = None  # reads that layer's K/V rows and writes none (Gemma 4 KV sharing)

    kind = "attention"

    @property
    def has_kv(self) -> bool:
        return self.kv_source is None

    @property
    def row_shape(self) -> tuple[int, int]:
        """(KV heads, head size) of one token's K (or V) row."""
        return self.num_kv_heads, self.head_dim

    def describe(self) -> str:
        parts = [f"attention ({self.num_kv_heads} KV heads x {self.head_dim}"]
        if self.window is not None:
            parts.append(f", sliding window {self.window}")
        if self.bidirectional_items:
            parts.append(", bidirectional items")
        if self.kv_source is not None:
            parts.append(f", KV of layer {self.kv_source}")
        return "".join(parts) + ")"


@dataclass(frozen=True)
class LinearStateSpec:
    conv_shape: tuple[int, int]  # (conv dim, kernel columns): the last K inputs of the causal conv
    recurrent_shape: tuple[int, int, int]  # (value heads, key head size, value head size), float32
    module_class: str  # the transformers class whose forward the engine runs over its state pool

    kind = "linear_state"

    @property
    def has_kv(self) -> bool:
        return False

    def describe(self) -> str:
        h, dk, dv = self.recurrent_shape
        return f"linear state ({self.module_class}: conv {self.conv_shape[0]}x{self.conv_shape[1]}, {h}x{dk}x{dv})"


@dataclass(frozen=True)
class UnknownLayerSpec:
    """A layer type transformers names that mmserve has no spec for: always refused."""

    layer_type: str

    kind = "unknown"

    @property
    def has_kv(self) -> bool:
        return False

    def describe(self) -> str:
        return f"{self.layer_type!r}"


LayerSpec = AttentionSpec | LinearStateSpec | UnknownLayerSpec


def layer_specs_from_hf(
    text_config, linear_module_class: str | None = None, bidirectional: frozenset[str] = frozenset()
) -> tuple[LayerSpec, ...]:
    """One spec per decoder layer from a transformers text config: `layer_types` (all `full_attention` when the
    config has none), `sliding_window`, per-layer head shapes (`per_layer_config`: Gemma 4's wider full layers),
    KV sharing (`kv_sharing_modes`: a "reuse" layer reads the rows of the last layer of its type that writes
    them), the `linear_*` fields of Gated DeltaNet layers. `linear_module_class` is the family's transformers
    class for its linear-attention layers (None: the family has none); `bidirectional` names the layer types
    whose attention lets an item's tokens see each other both ways (the family knows: Gemma 3 all, Gemma 4 its
    sliding layers)."""
    n = text_config.num_hidden_layers
    types = list(getattr(text_config, "layer_types", None) or ["full_attention"] * n)
    if len(types) < n:
        raise ValueError(f"config lists {len(types)} layer_types for {n} layers")
    shapes = [head_shape(text_config, i) for i in range(n)]
    sources = _kv_sources(text_config, types[:n])
    specs: list[LayerSpec] = []
    for i, layer_type in enumerate(types[:n]):
        heads, dim = shapes[i]
        both_ways = layer_type in bidirectional
        if layer_type == "full_attention":
            specs.append(AttentionSpec(heads, dim, None, both_ways, sources[i]))
        elif layer_type == "sliding_attention":
            specs.append(AttentionSpec(heads, dim, text_config.sliding_window, both_ways, sources[i]))
        elif layer_type == "linear_attention" and linear_module_class is not None:
            specs.append(_gated_deltanet(text_config, linear_module_class))
        else:
            specs.append(UnknownLayerSpec(layer_type))
    return tuple(specs)


def head_shape(text_config, layer: int) -> tuple[int, int]:
    """(KV heads, head size) of one layer: its own entry of `per_layer_config` where the config has one (its
    global `head_dim` then raises rather than answer for every layer)."""
    per_layer = getattr(text_config, "per_layer_config", None)
    config = per_layer[layer] if per_layer is not None else text_config
    heads = getattr(config, "num_key_value_heads", None) or text_config.num_attention_heads
    dim = getattr(config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return heads, dim


def _kv_sources(text_config, types: list[str]) -> list[int | None]:
    """Per layer, the layer whose K/V rows it reads instead of writing its own (transformers' "reuse" layers read
    what the last "store" layer of their type wrote), else None."""
    modes = getattr(text_config, "kv_sharing_modes", None)
    if not modes or all(m is None for m in modes):
        return [None] * len(types)
    store = {types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    return [store[types[i]] if mode == "reuse" else None for i, mode in enumerate(modes)]


def _gated_deltanet(text_config, module_class: str) -> LinearStateSpec:
    hk, dk = text_config.linear_num_key_heads, text_config.linear_key_head_dim
    hv, dv = text_config.linear_num_value_heads, text_config.linear_value_head_dim
    conv_dim = 2 * hk * dk + hv * dv  # the q, k and v channels share one depthwise conv
    return LinearStateSpec((conv_dim, text_config.linear_conv_kernel_dim), (hv, dk, dv), module_class)


def kv_layers(specs: tuple[LayerSpec, ...]) -> list[int]:
    """The layers that write K/V rows."""
    return [i for i, s in enumerate(specs) if s.has_kv]


def window_of(specs: tuple[LayerSpec, ...]) -> int | None:
    """The sliding window of a model's windowed attention layers (None: it has none). The engine keeps those
    layers' rows in a pool of their own, freed behind the window; `check_runnable` refuses two window sizes."""
    windows = {s.window for s in specs if isinstance(s, AttentionSpec) and s.window is not None}
    return min(windows) if windows else None


def has_item_blocks(specs: tuple[LayerSpec, ...]) -> bool:
    """Whether some layer lets an item's tokens attend both ways: its items must then be computed whole (never
    cut by a prefill chunk, never cached in part)."""
    return any(isinstance(s, AttentionSpec) and s.bidirectional_items for s in specs)


def linear_layers(specs: tuple[LayerSpec, ...]) -> list[int]:
    return [i for i, s in enumerate(specs) if isinstance(s, LinearStateSpec)]
