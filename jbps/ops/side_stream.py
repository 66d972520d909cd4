"""A part of a program run on a stream of its own on XLA:GPU, so that its
waits do not hold up the rest of the step.

XLA:GPU runs a custom call's work in stream order: a bucket's jbps_psum
waits on XLA's stream for its sum, and every kernel enqueued after it (the
rest of the backward pass) waits too. A call to a function whose
`_xla_stream_annotation` names another stream becomes an async pair: XLA
schedules its start as early as its operands allow and its done as late as
its first user allows, runs the function on that stream, and makes the
compute stream wait for it only at the done. The bucket's custom call then
stages, submits and waits on the side stream while the compute stream goes on
with the backward pass; the done sits before jbps_join, after the last bucket.

The annotation is XLA:GPU's (jax's `compute_on("gpu_stream:N")` emits the
same). Where XLA does not act on it (jax < 0.6 keeps it behind
--xla_gpu_experimental_stream_annotation), the call is inlined and the bucket
waits on the compute stream, as before: the same sums, only no overlap.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax._src import core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect

STREAM_ANNOTATION = "_xla_stream_annotation"

on_stream_p = core.Primitive("jbps_on_stream")
on_stream_p.multiple_results = True


def on_stream(fn: Callable[..., Sequence[jax.Array]], args: Sequence[jax.Array], stream: int) -> list[jax.Array]:
    """fn(*args), lowered as a function called on XLA:GPU stream `stream`
    (1 or more: 0 is the compute stream). Every array fn uses must be in
    `args`: it is traced on its own."""
    if stream < 1:
        raise ValueError(f"side_stream.on_stream: stream must be 1 or more, got {stream}")
    closed = jax.make_jaxpr(lambda *xs: list(fn(*xs)))(*args)
    return on_stream_p.bind(*args, jaxpr=closed, stream=stream)


on_stream_p.def_impl(lambda *args, jaxpr, stream: core.jaxpr_as_fun(jaxpr)(*args))
on_stream_p.def_abstract_eval(lambda *avals, jaxpr, stream: jaxpr.out_avals)


def _lower(ctx, *args, jaxpr, stream):
    module = ctx.module_context
    in_types = [a.type for a in args]
    with ir.InsertionPoint(module.module.body):
        fn = func_dialect.FuncOp("jbps_on_stream", ir.FunctionType.get(in_types, []))
    fn.attributes["sym_visibility"] = ir.StringAttr.get("private")
    name = module.symbol_table.insert(fn)
    block = fn.add_entry_block()
    with ir.InsertionPoint(block):
        outs = mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *block.arguments)
        outs = [v for out in outs for v in (out if isinstance(out, (list, tuple)) else [out])]
        func_dialect.ReturnOp(outs)
    out_types = [v.type for v in outs]
    fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(in_types, out_types))
    call = func_dialect.CallOp(out_types, ir.FlatSymbolRefAttr.get(name.value), list(args))
    call.operation.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
        {STREAM_ANNOTATION: ir.StringAttr.get(str(stream)), "inlineable": ir.StringAttr.get("false")}
    )
    return list(call.results)


mlir.register_lowering(on_stream_p, _lower)
