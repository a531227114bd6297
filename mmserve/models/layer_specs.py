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


def layer_specs_from_hf(text_config, linear_module_class: str | None = None) -> tuple[LayerSpec, ...]:
    """One spec per decoder layer from a transformers text config: `layer_types` (all `full_attention` when the
    config has none), `sliding_window`, the `linear_*` fields of Gated DeltaNet layers. `linear_module_class` is
    the family's transformers class for its linear-attention layers (None: the family has none)."""
    n = text_config.num_hidden_layers
    types = list(getattr(text_config, "layer_types", None) or ["full_attention"] * n)
    if len(types) < n:
        raise ValueError(f"config lists {len(types)} layer_types for {n} layers")
    kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    specs: list[LayerSpec] = []
    for layer_type in types[:n]:
        if layer_type == "full_attention":
            specs.append(AttentionSpec(kv_heads, head_dim))
        elif layer_type == "sliding_attention":
            specs.append(AttentionSpec(kv_heads, head_dim, window=text_config.sliding_window))
        elif layer_type == "linear_attention" and linear_module_class is not None:
            specs.append(_gated_deltanet(text_config, linear_module_class))
        else:
            specs.append(UnknownLayerSpec(layer_type))
    return tuple(specs)


def _gated_deltanet(text_config, module_class: str) -> LinearStateSpec:
    hk, dk = text_config.linear_num_key_heads, text_config.linear_key_head_dim
    hv, dv = text_config.linear_num_value_heads, text_config.linear_value_head_dim
    conv_dim = 2 * hk * dk + hv * dv  # the q, k and v channels share one depthwise conv
    return LinearStateSpec((conv_dim, text_config.linear_conv_kernel_dim), (hv, dk, dv), module_class)


def kv_layers(specs: tuple[LayerSpec, ...]) -> list[int]:
    """The layers that write K/V rows."""
    return [i for i, s in enumerate(specs) if s.has_kv]


def linear_layers(specs: tuple[LayerSpec, ...]) -> list[int]:
    return [i for i, s in enumerate(specs) if isinstance(s, LinearStateSpec)]
