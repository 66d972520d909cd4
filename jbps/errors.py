"""The exception jbps raises for its own failures, and how to get it from a psum."""

from __future__ import annotations

import contextlib
import re
import sys
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


# A failed step's error reaches the next steps as their input's error, each
# wrapping it once more: "Error dispatching computation: " hundreds of times.
_REPEATED = re.compile(r"((?:[^:\n]{1,80}): )\1+")


def collapse_repeats(text: str) -> str:
    """`text` with every prefix repeated back to back said once, with its count:
    "Error dispatching computation (x287): jbps: psum timed out ..."."""

    def once(match: re.Match) -> str:
        unit = match.group(1)
        return f"{unit[:-2]} (x{len(match.group(0)) // len(unit)}): "

    return _REPEATED.sub(once, text)


def _collapsing_excepthook(exc_type, value, tb) -> None:
    """Python's own traceback, its repeated prefixes collapsed (collapse_repeats)."""
    import traceback

    sys.stderr.write(collapse_repeats("".join(traceback.format_exception(exc_type, value, tb))))


def install_excepthook() -> None:
    """An uncaught exception's traceback prints with its repeats collapsed;
    a hook the program installed itself is left alone."""
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _collapsing_excepthook
