"""Which operands of a psum are parameters of the program that its caller keeps.

jbps's custom call sums each tensor in place, in its operand's buffer, when
XLA can give that buffer up (an intermediate, or an argument the caller
donated). An argument the caller keeps cannot be given up: XLA would copy it
into a fresh output buffer first, touching every page of that buffer before
the sum does (for 64 MiB, page faults that cost as much as the psum itself).
For such an operand the sum goes straight into a fresh output instead, which
the handler asks the kernel to back with huge pages (xla_ext/fresh_output.h).

Read from the module being lowered: an argument of its main function whose
attributes mark no donation (`tf.aliasing_output`, `jax.buffer_donor`).
Anything else (a value computed in the program, an argument of a nested
function, an attribute this jax version spells otherwise) counts as not kept,
which keeps the in-place sum.
"""

from __future__ import annotations

from typing import Sequence

from jax._src.lib.mlir import ir

_DONATION_ATTRS = ("tf.aliasing_output", "jax.buffer_donor")


def kept_parameters(operands: Sequence[ir.Value]) -> list[bool]:
    return [_is_kept_parameter(v) for v in operands]


def _block_argument(value: ir.Value) -> ir.BlockArgument | None:
    if isinstance(value, ir.BlockArgument):  # newer bindings hand out the subclass
        return value
    is_block_argument = getattr(ir.BlockArgument, "isinstance", None)  # older ones a cast
    return ir.BlockArgument(value) if is_block_argument is not None and is_block_argument(value) else None


def _is_kept_parameter(value: ir.Value) -> bool:
    try:
        arg = _block_argument(value)
        if arg is None:
            return False
        func = arg.owner.owner
        if func.operation.name != "func.func" or ir.StringAttr(func.attributes["sym_name"]).value != "main":
            return False
        if "arg_attrs" not in func.attributes:
            return True
        attrs = ir.DictAttr(ir.ArrayAttr(func.attributes["arg_attrs"])[arg.arg_number])
        return not any(name in attrs for name in _DONATION_ATTRS)
    except Exception:  # an IR this reading does not know: in place, as before
        return False
