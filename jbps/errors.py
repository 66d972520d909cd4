"""The exception jbps raises for its own failures, and how to get it from a psum."""

from __future__ import annotations

import contextlib
from typing import Iterator

# Failures inside a running psum come out of XLA with this prefix.
PREFIX = "jbps:"


class JbpsError(RuntimeError):
    """A jbps failure: bad configuration, unreachable server, misuse of the API,
    or a job that failed (a lost worker or server: see `jbps.check()`).

    Failures inside a running psum (timeouts, a lost peer, workers that
    disagree on a tree) are raised by jax when the result is used, as
    ``jax.errors.JaxRuntimeError`` (or ValueError on some dispatch paths),
    with ``jbps:`` starting the message after XLA's status code. Python's
    ``except`` cannot be made to match that type, so: wrap the steps in
    ``with jbps.errors.converted():`` to get them as JbpsError, or test a caught
    exception with ``is_jbps_error``.
    """


def is_jbps_error(exc: BaseException) -> bool:
    """True for a JbpsError, and for XLA's runtime error carrying a failure of
    a jbps psum (its message starts with "jbps:")."""
    # jax raises a failed custom call as JaxRuntimeError (XlaRuntimeError
    # before 0.6), and in some dispatch paths as ValueError: go by the message.
    return isinstance(exc, JbpsError) or (
        isinstance(exc, (RuntimeError, ValueError)) and PREFIX in str(exc).split("\n", 1)[0]
    )


@contextlib.contextmanager
def converted() -> Iterator[None]:
    """Re-raises failures of jbps psums inside the block as JbpsError (the
    original exception is its __cause__); anything else passes unchanged."""
    try:
        yield
    except JbpsError:
        raise
    except Exception as exc:
        if not is_jbps_error(exc):
            raise
        message = str(exc)
        start = message.find(PREFIX)
        raise JbpsError(message[start:] if start >= 0 else message) from exc
