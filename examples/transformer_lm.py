"""A small decoder-only transformer (flax.nnx) learning the characters of
Python's own standard library sources (a corpus every Python install ships),
trained data-parallel with jbps: nnx.Optimizer around
jbps.optax.distributed(optax.adamw(...)), rank 0's parameters broadcast;
with --compression onebit or topk, jbps.optax.onebit_adam (1-bit Adam).

    python examples/transformer_lm.py
    jbps run -n 2 python examples/transformer_lm.py
    mpirun -np 2 python examples/transformer_lm.py

Each worker samples its own windows of the corpus; the gradients are averaged
over the job. Prints the loss going down, tokens/s over the job, and the
communication share of step time.
"""

import argparse
import inspect
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jbps

VOCAB = 256  # bytes


def load_corpus(max_bytes):
    """The first max_bytes of the standard library's top-level .py files."""
    stdlib = os.path.dirname(os.__file__)
    data = bytearray()
    for name in sorted(os.listdir(stdlib)):
        if name.endswith(".py") and len(data) < max_bytes:
            with open(os.path.join(stdlib, name), "rb") as f:
                data += f.read()
    return np.frombuffer(bytes(data[:max_bytes]), np.uint8)


# Newer flax wants lists of modules wrapped; older flax has no nnx.List.
_ModuleList = getattr(nnx, "List", list)


class Block(nnx.Module):
    def __init__(self, dim, heads, rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class LM(nnx.Module):
    def __init__(self, seq_len, dim, heads, layers, rngs):
        self.tokens = nnx.Embed(VOCAB, dim, rngs=rngs)
        self.positions = nnx.Embed(seq_len, dim, rngs=rngs)
        self.blocks = _ModuleList([Block(dim, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, VOCAB, rngs=rngs)

    def __call__(self, ids):
        x = self.tokens(ids) + self.positions(jnp.arange(ids.shape[1]))
        mask = nnx.make_causal_mask(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


# flax 0.11 moved the model into Optimizer.update's arguments.
_UPDATE_TAKES_MODEL = "model" in inspect.signature(nnx.Optimizer.update).parameters


@nnx.jit
def train_step(model, optimizer, ids):
    def loss_fn(model):
        logits = model(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    if _UPDATE_TAKES_MODEL:
        optimizer.update(model, grads)  # the distributed optimizer averages grads over the job
    else:
        optimizer.update(grads)
    return loss


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--compression",
        metavar="{bf16,fp16,onebit,topk,topk:FRACTION}",
        default=None,
        help="gradients on the wire (default: float32 as computed); topk:0.05 keeps 51 of every 1024 "
        "values, where topk keeps 10 (jbps.optax.distributed checks the value)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="with onebit or topk: uncompressed steps before Adam's first moment travels compressed "
        "(jbps.optax.onebit_adam; default a fifth of --steps)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args()

    jbps.init()
    rank, workers = jbps.rank(), jbps.size()
    corpus = load_corpus(args.corpus_bytes)
    model = LM(args.seq_len + 1, args.dim, args.heads, args.layers, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    nnx.update(model, jbps.broadcast_parameters(params))  # every worker starts from rank 0's
    if args.compression in (None, "bf16", "fp16"):
        tx = jbps.optax.distributed(optax.adamw(args.lr, weight_decay=0.01), compression=args.compression)
    else:  # onebit, topk: Adam's first moment travels compressed after a warm-up (1-bit Adam)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, round(args.steps * 0.2))
        tx = jbps.optax.onebit_adam(args.lr, weight_decay=0.01, warmup_steps=warmup, compression=args.compression)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if rank == 0:
        count = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
        print(f"{workers} worker(s), {count:,} parameters, corpus {len(corpus):,} bytes of Python's stdlib")

    rng = np.random.default_rng(rank)  # each worker its own windows
    window = np.arange(args.seq_len + 1)
    tokens = workers * args.batch_size * args.seq_len
    busy, start, first_loss = jbps.engine_stats()["busy_seconds"], None, None
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(corpus) - args.seq_len - 1, args.batch_size)
        loss = train_step(model, optimizer, jnp.asarray(corpus[starts[:, None] + window], jnp.int32))
        if step == 1:  # time from here, after compilation
            jax.block_until_ready(loss)
            first_loss, start, busy = float(loss), time.perf_counter(), jbps.engine_stats()["busy_seconds"]
        elif step % args.log_every == 0 or step == args.steps:
            loss = float(loss)
            elapsed = time.perf_counter() - start
            share = jbps.communication_share(jbps.engine_stats()["busy_seconds"] - busy, elapsed)  # every worker
            if rank == 0:
                print(
                    f"step {step:4d}  loss {loss:.3f}  {tokens * (step - 1) / elapsed:,.0f} tokens/s over "
                    f"the job  communication {share.communication:.0%} of step time",
                    flush=True,
                )
    if rank == 0:
        print(f"loss {first_loss:.3f} -> {loss:.3f}")
    jbps.shutdown()


if __name__ == "__main__":
    main()
