"""The exception jbps raises for its own failures."""


class JbpsError(RuntimeError):
    """A jbps failure: bad configuration, unreachable server, misuse of the API.

    Failures inside a running psum (timeouts, a lost server, workers that
    disagree on a tensor) are raised by XLA when the result is used, as
    ``jax.errors.JaxRuntimeError``; their message starts with ``jbps:``.
    """
