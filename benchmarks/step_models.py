"""The models a benchmark step trains (benchmarks/step_worker.py): a plain-jax
MLP, and the examples' own ResNet (examples/resnet_synthetic.py, flax.linen)
and transformer (examples/transformer_lm.py, flax.nnx), each as parameters,
a loss of (parameters, *inputs) and one worker's synthetic inputs.

--layers and --width size each: the MLP's square layers; the ResNet's
residual blocks per stage and its first stage's channels (then 2x and 4x, on
32 x 32 images, 100 classes); the transformer's blocks and model width (4
heads, 64 tokens a sequence). --batch is samples per worker per step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

MODELS = ("mlp", "resnet", "transformer")
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
IMAGE_SIZE, CLASSES = 32, 100
SEQ_LEN, HEADS = 64, 4


@dataclasses.dataclass
class StepModel:
    params: Any
    loss: Callable[..., jax.Array]  # loss(params, *inputs)
    inputs: tuple  # this worker's batch: arrays whose first axis is the sample
    describe: str


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"jbps_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mlp(layers: int, width: int, batch: int, rng) -> StepModel:
    key = jax.random.PRNGKey(0)
    params = [
        {"w": jax.random.normal(jax.random.fold_in(key, i), (width, width)) / np.sqrt(width), "b": jnp.zeros((width,))}
        for i in range(layers)
    ]

    def loss(params, x, y):
        h = x
        for layer in params:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean((h - y) ** 2)

    inputs = tuple(jnp.asarray(rng.normal(size=(batch, width)), jnp.float32) for _ in range(2))
    return StepModel(params, loss, inputs, f"an MLP of {layers} x {width}² float32")


def _resnet(layers: int, width: int, batch: int, rng) -> StepModel:
    example = _example("resnet_synthetic")
    model = example.ResNet([width, 2 * width, 4 * width], layers, CLASSES)
    images = jnp.asarray(rng.standard_normal((batch, IMAGE_SIZE, IMAGE_SIZE, 3)), jnp.float32)
    variables = model.init(jax.random.PRNGKey(0), images[:1])
    batch_stats = variables["batch_stats"]

    def loss(params, images, labels):
        # Training mode; the batch statistics' update is computed as in the
        # example's step and not kept (the same work, a fixed state to time).
        logits, _ = model.apply({"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    labels = jnp.asarray(rng.integers(0, CLASSES, batch), jnp.int32)
    return StepModel(
        variables["params"],
        loss,
        (images, labels),
        f"the ResNet of examples/resnet_synthetic.py ({layers} blocks per stage, {width}-{4 * width} channels, "
        f"{IMAGE_SIZE}x{IMAGE_SIZE} images)",
    )


def _transformer(layers: int, width: int, batch: int, rng) -> StepModel:
    from flax import nnx

    example = _example("transformer_lm")
    graphdef, params, rest = nnx.split(example.LM(SEQ_LEN + 1, width, HEADS, layers, rngs=nnx.Rngs(0)), nnx.Param, ...)

    def loss(params, ids):
        logits = nnx.merge(graphdef, params, rest)(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    ids = jnp.asarray(rng.integers(0, example.VOCAB, (batch, SEQ_LEN + 1)), jnp.int32)
    return StepModel(
        params,
        loss,
        (ids,),
        f"the transformer of examples/transformer_lm.py ({layers} blocks, width {width}, {SEQ_LEN} tokens)",
    )


def add_model_flags(p, *, layers: int = 8, batch: int = 1024, steps: int = 9) -> None:
    """The model and step-count flags every step benchmark takes (worker_args passes them on)."""
    p.add_argument("--model", choices=MODELS, default="mlp", help="what the step trains (default mlp)")
    p.add_argument(
        "--layers", type=int, default=layers, help=f"square layers of the MLP (default {layers}); the others' blocks"
    )
    p.add_argument("--width", type=int, default=1024, help="their width (default 1024: 4 MiB each)")
    p.add_argument("--batch", type=int, default=batch, help=f"examples per worker per step (default {batch})")
    p.add_argument("--steps", type=int, default=steps, help=f"timed steps (default {steps})")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")


def worker_args(args) -> list[str]:
    """The flags that give benchmarks/step_worker.py a driver's model and step count."""
    flags = {"model": args.model, "layers": args.layers, "width": args.width, "batch": args.batch}
    flags.update(steps=args.steps, warmup=args.warmup)
    return [item for name, value in flags.items() for item in (f"--{name}", str(value))]


def build(name: str, layers: int, width: int, batch: int, rank: int) -> StepModel:
    """Model `name` with every worker's parameters alike and its own inputs."""
    return {"mlp": _mlp, "resnet": _resnet, "transformer": _transformer}[name](
        layers, width, batch, np.random.default_rng(rank)
    )
