"""A quantized checkpoint's layers, taken out of transformers' loading and installed as QuantLinear layers.

`load_parts` (mmserve.models.weights) hands transformers every tensor but those of quantized layers (which
its Linear modules cannot hold); each such layer's tensors are read here, converted into mmserve's layout
(formats.py) and put in place of the Linear transformers built, with the bias transformers loaded. Layers are
found by the format's marker tensor and mapped to model paths through the same renaming rules transformers
applies to `<layer>.weight`, so a checkpoint of an older layout loads as its unquantized form does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mmserve.quant.formats import CheckpointFormat, read_format, to_layout
from mmserve.quant.linear import QuantLinear


@dataclass
class QuantizedTensors:
    fmt: CheckpointFormat | None = None
    keys: set[str] = field(default_factory=set)  # checkpoint keys read here, not by transformers
    layers: dict[str, tuple[str, dict]] = field(
        default_factory=dict
    )  # model path -> (checkpoint prefix, tensors)

    @classmethod
    def of(
        cls, hf_config, files, rename: Callable[[str], str], prefixes: tuple[str, ...]
    ) -> QuantizedTensors:
        """The quantized layers of the checkpoint `files` whose model path (`rename` of `<layer>.weight`) is
        under `prefixes`; nothing for an unquantized checkpoint."""
        fmt = read_format(getattr(hf_config, "quantization_config", None))
        found = cls(fmt)
        if fmt is None:
            return found
        suffix = "." + fmt.marker
        handles = {key: f for f in files for key in f.keys()}
        for key in handles:
            if not key.endswith(suffix):
                continue
            layer = key[: -len(suffix)]
            target = rename(layer + ".weight")
            names = [n for n in fmt.names if f"{layer}.{n}" in handles]
            found.keys.update(f"{layer}.{n}" for n in names)
            if target.startswith(prefixes):
                tensors = {n: handles[f"{layer}.{n}"].get_tensor(f"{layer}.{n}") for n in names}
                found.layers[target.removesuffix(".weight")] = (layer, tensors)
        return found

    def install(self, model: torch.nn.Module, dtype: torch.dtype) -> set[str]:
        """Replaces each quantized layer's Linear in `model` with its QuantLinear; returns the `.weight` keys
        that are so accounted for. Raises ValueError naming a tensor that is missing or does not fit."""
        done = set()
        for path, (layer, tensors) in self.layers.items():
            linear = model.get_submodule(path)
            if not isinstance(linear, torch.nn.Linear):
                raise ValueError(
                    f"quantized checkpoint: {layer} is quantized but {path} is not a linear layer"
                )
            weight = to_layout(self.fmt, tensors, layer, (linear.out_features, linear.in_features))
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent), attr, QuantLinear(weight, linear.bias, dtype))
            done.add(path + ".weight")
        return done
