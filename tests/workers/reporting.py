"""The one JSON line a test worker prints at the end: its report, with the
first exception of its body as the error (the test reads it), after jbps
shut down."""

import contextlib
import json
import sys

import jbps


@contextlib.contextmanager
def reported(report: dict):
    report.setdefault("error", None)
    try:
        yield report
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(exc).__name__}: {exc}"
    jbps.shutdown()
    sys.stdout.write(json.dumps(report) + "\n")
