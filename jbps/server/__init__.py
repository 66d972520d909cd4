"""The summation server: `python -m jbps.server --bind HOST:PORT --num-workers N`."""
