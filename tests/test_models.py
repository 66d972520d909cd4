"""Built-in model tensor lists match the published parameter counts; JSON specs load or fail clearly."""

import json
import math

import pytest

from jbps.partition.models import BUILTIN_MODELS, builtin_model, load_model_spec

PUBLISHED_COUNTS = {
    "resnet50": 25_557_032,
    "vgg16": 138_357_544,
    "bert-base": 109_482_240,
}

FIRST_AND_LAST = {
    "resnet50": (("conv1.weight", (64, 3, 7, 7)), ("fc.bias", (1000,))),
    "vgg16": (("features.0.weight", (64, 3, 3, 3)), ("classifier.6.bias", (1000,))),
    "bert-base": (("embeddings.word_embeddings", (30522, 768)), ("pooler.dense.bias", (768,))),
}


def test_every_builtin_has_a_published_count():
    assert set(BUILTIN_MODELS) == set(PUBLISHED_COUNTS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_builtin_total_matches_published_count(name):
    assert sum(math.prod(shape) for _, shape in builtin_model(name)) == PUBLISHED_COUNTS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_builtin_names_are_unique_and_shapes_positive(name):
    tensors = builtin_model(name)
    names = [n for n, _ in tensors]
    assert len(names) == len(set(names))
    assert all(shape and all(isinstance(d, int) and d > 0 for d in shape) for _, shape in tensors)


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_builtin_is_in_forward_order(name):
    tensors = builtin_model(name)
    first, last = FIRST_AND_LAST[name]
    assert tensors[0] == first
    assert tensors[-1] == last


def test_resnet50_has_no_running_statistics_and_one_projection_per_stage():
    names = [n for n, _ in builtin_model("resnet50")]
    assert not any("running" in n or "num_batches" in n for n in names)
    assert [n for n in names if n.endswith("downsample.0.weight")] == [
        f"layer{s}.0.downsample.0.weight" for s in (1, 2, 3, 4)
    ]


def test_bert_layers_follow_each_other():
    names = [n for n, _ in builtin_model("bert-base")]
    firsts = [names.index(f"encoder.layer.{i}.attention.self.query.kernel") for i in range(12)]
    assert firsts == sorted(firsts)
    assert "encoder.layer.12.attention.self.query.kernel" not in names


def test_unknown_model_raises_naming_the_known_ones():
    with pytest.raises(ValueError) as info:
        builtin_model("resnet51")
    message = str(info.value)
    assert "resnet51" in message
    for known in PUBLISHED_COUNTS:
        assert known in message


def write_spec(tmp_path, content):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(content))
    return str(path)


def test_load_dict_spec_keeps_file_order_as_float32(tmp_path):
    path = write_spec(tmp_path, {"b.weight": [4, 3], "a.bias": [4], "scalar": []})
    assert load_model_spec(path) == [
        ("b.weight", (4, 3), "float32"),
        ("a.bias", (4,), "float32"),
        ("scalar", (), "float32"),
    ]


def test_load_list_spec_with_dtypes(tmp_path):
    path = write_spec(
        tmp_path,
        [
            {"name": "emb", "shape": [10, 8], "dtype": "bfloat16"},
            {"name": "w", "shape": [8, 8], "dtype": "float16"},
            {"name": "d", "shape": [2], "dtype": "float64"},
            {"name": "step", "shape": [1], "dtype": "int32"},
            {"name": "b", "shape": [8]},
        ],
    )
    assert load_model_spec(path) == [
        ("emb", (10, 8), "bfloat16"),
        ("w", (8, 8), "float16"),
        ("d", (2,), "float64"),
        ("step", (1,), "int32"),
        ("b", (8,), "float32"),
    ]


@pytest.mark.parametrize(
    "content, offender",
    [
        ({"ok": [2], "neg": [3, -1]}, "neg"),
        ({"ok": [2], "flat": 7}, "flat"),
        ({"ok": [2], "half": [2.5]}, "half"),
        ([{"name": "ok", "shape": [2]}, {"name": "neg", "shape": [-4]}], "neg"),
        ([{"name": "ok", "shape": [2]}, {"name": "str", "shape": "2,3"}], "str"),
        ([{"name": "ok", "shape": [2]}, {"name": "odd", "shape": [2], "dtype": "complex64"}], "odd"),
        ([{"name": "ok", "shape": [2]}, {"name": "typo", "shpae": [2]}], "typo"),
        ([{"name": "twice", "shape": [2]}, {"name": "twice", "shape": [3]}], "twice"),
    ],
)
def test_bad_spec_raises_naming_file_and_entry(tmp_path, content, offender):
    path = write_spec(tmp_path, content)
    with pytest.raises(ValueError) as info:
        load_model_spec(path)
    assert path in str(info.value)
    assert offender in str(info.value)


@pytest.mark.parametrize("text", ["not json", "42", "[]", "{}"])
def test_spec_that_is_not_a_tensor_list_raises_naming_file(tmp_path, text):
    path = tmp_path / "spec.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="spec.json"):
        load_model_spec(str(path))
