"""Parameter tensors of well-known models, for predicting communication.

`jbps plan` needs the gradients a model would push, not the model itself, so
each built-in here is just its parameter tensors as (name, shape) pairs in
forward order (first layer first), all float32. Batch-norm running statistics
are left out: they are not gradients. The shapes follow the reference
implementations and add up to the published parameter counts:

    resnet50   torchvision ResNet-50, ImageNet 1000 classes   25,557,032
    vgg16      torchvision VGG-16 (configuration D)           138,357,544
    bert-base  Google BERT-base uncased (TF checkpoint names) 109,482,240

Convolutions are (out, in, kh, kw) and torchvision linear layers (out, in);
BERT kernels are (in, out) as in the TF checkpoint.

`load_model_spec` reads any other model from a JSON file.
"""

from __future__ import annotations

import json
from typing import Any, Callable

Shape = tuple[int, ...]
Tensor = tuple[str, Shape]

SPEC_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32")


def _batch_norm(prefix: str, channels: int) -> list[Tensor]:
    return [(f"{prefix}.weight", (channels,)), (f"{prefix}.bias", (channels,))]


def _conv_bn(conv: str, bn: str, c_in: int, c_out: int, k: int) -> list[Tensor]:
    return [(f"{conv}.weight", (c_out, c_in, k, k))] + _batch_norm(bn, c_out)


def resnet50() -> list[Tensor]:
    tensors = _conv_bn("conv1", "bn1", 3, 64, 7)
    c_in = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), start=1):
        c_out = width * 4
        for block in range(blocks):
            p = f"layer{stage}.{block}"
            tensors += _conv_bn(f"{p}.conv1", f"{p}.bn1", c_in, width, 1)
            tensors += _conv_bn(f"{p}.conv2", f"{p}.bn2", width, width, 3)
            tensors += _conv_bn(f"{p}.conv3", f"{p}.bn3", width, c_out, 1)
            if block == 0:
                tensors += _conv_bn(f"{p}.downsample.0", f"{p}.downsample.1", c_in, c_out, 1)
            c_in = c_out
    return tensors + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def vgg16() -> list[Tensor]:
    # Configuration D; "M" is a max-pool. Indices are torchvision's nn.Sequential slots.
    config: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    tensors: list[Tensor] = []
    index, c_in = 0, 3
    for layer in config:
        if not isinstance(layer, int):  # "M"
            index += 1
            continue
        tensors += [(f"features.{index}.weight", (layer, c_in, 3, 3)), (f"features.{index}.bias", (layer,))]
        index, c_in = index + 2, layer  # conv, relu
    for index, (n_in, n_out) in zip((0, 3, 6), ((512 * 7 * 7, 4096), (4096, 4096), (4096, 1000))):
        tensors += [(f"classifier.{index}.weight", (n_out, n_in)), (f"classifier.{index}.bias", (n_out,))]
    return tensors


def _dense(prefix: str, n_in: int, n_out: int) -> list[Tensor]:
    return [(f"{prefix}.kernel", (n_in, n_out)), (f"{prefix}.bias", (n_out,))]


def _layer_norm(prefix: str, width: int) -> list[Tensor]:
    return [(f"{prefix}.gamma", (width,)), (f"{prefix}.beta", (width,))]


def bert_base() -> list[Tensor]:
    hidden, intermediate = 768, 3072
    tensors: list[Tensor] = [
        ("embeddings.word_embeddings", (30522, hidden)),
        ("embeddings.position_embeddings", (512, hidden)),
        ("embeddings.token_type_embeddings", (2, hidden)),
    ] + _layer_norm("embeddings.LayerNorm", hidden)
    for layer in range(12):
        p = f"encoder.layer.{layer}"
        for head in ("query", "key", "value"):
            tensors += _dense(f"{p}.attention.self.{head}", hidden, hidden)
        tensors += _dense(f"{p}.attention.output.dense", hidden, hidden)
        tensors += _layer_norm(f"{p}.attention.output.LayerNorm", hidden)
        tensors += _dense(f"{p}.intermediate.dense", hidden, intermediate)
        tensors += _dense(f"{p}.output.dense", intermediate, hidden)
        tensors += _layer_norm(f"{p}.output.LayerNorm", hidden)
    return tensors + _dense("pooler.dense", hidden, hidden)


BUILTIN_MODELS: dict[str, Callable[[], list[Tensor]]] = {
    "resnet50": resnet50,
    "vgg16": vgg16,
    "bert-base": bert_base,
}


def builtin_model(name: str) -> list[Tensor]:
    """The (name, shape) parameter tensors of a built-in model, forward order, all float32."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(BUILTIN_MODELS)}")
    return BUILTIN_MODELS[name]()


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _check_entry(name: Any, shape: Any, dtype: Any) -> tuple[str, Shape, str]:
    if not isinstance(name, str) or not name:
        raise ValueError("name must be a non-empty string")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"shape must be a list of non-negative integers, got {shape!r}")
    if dtype not in SPEC_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SPEC_DTYPES)}, got {dtype!r}")
    return name, tuple(shape), dtype


def _spec_entries(spec: Any) -> list[tuple[str, Any, Any, Any]]:
    """(label for errors, name, shape, dtype) for each entry of either spec form."""
    if isinstance(spec, dict):
        return [(repr(name), name, shape, "float32") for name, shape in spec.items()]
    if not isinstance(spec, list):
        raise ValueError('expected {"name": [dims], ...} or [{"name", "shape", "dtype"}, ...]')
    entries = []
    for i, item in enumerate(spec):
        label = f"entry {i}" + (f" ({item.get('name')!r})" if isinstance(item, dict) else "")
        if not isinstance(item, dict) or not {"name", "shape"} <= item.keys() <= {"name", "shape", "dtype"}:
            raise ValueError(f"{label}: expected an object with name, shape and optional dtype, got {item!r}")
        entries.append((label, item["name"], item["shape"], item.get("dtype", "float32")))
    return entries


def load_model_spec(path: str) -> list[tuple[str, Shape, str]]:
    """(name, shape, dtype) of each tensor in a JSON model spec, in file order.

    The file holds either {"name": [d0, d1, ...], ...} (all float32) or
    [{"name": ..., "shape": [...], "dtype": "float32"}, ...] (dtype optional).
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        entries = _spec_entries(json.loads(text, object_pairs_hook=_reject_duplicate_keys))
    except ValueError as e:
        raise ValueError(f"model spec {path}: {e}") from None
    tensors: list[tuple[str, Shape, str]] = []
    seen: set[str] = set()
    for label, name, shape, dtype in entries:
        try:
            tensors.append(_check_entry(name, shape, dtype))
        except ValueError as e:
            raise ValueError(f"model spec {path}: {label}: {e}") from None
        if name in seen:
            raise ValueError(f"model spec {path}: {label}: tensor {name!r} appears more than once")
        seen.add(name)
    if not tensors:
        raise ValueError(f"model spec {path}: no tensors")
    return tensors
