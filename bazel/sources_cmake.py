"""Reads the source lists of xla_ext/sources.cmake, the one list both builds
use: every `set(JBPS_<NAME>_SOURCES ...)` becomes a list of paths relative to
the repository root. Run as a script it writes them as a Starlark file for the
Bazel build; tests/test_build_sources.py imports it to check both builds."""

import re
import sys

_SET = re.compile(r"set\(\s*(JBPS_\w+_SOURCES)\b(.*?)\)", re.S)
_DIR = "${CMAKE_CURRENT_LIST_DIR}/"


def parse(text, prefix="xla_ext/"):
    """{list name: [path, ...]} in file order; a path not under the list's own
    directory is an error naming it (Bazel could not build it)."""
    lists = {}
    for name, body in _SET.findall(re.sub(r"#.*", "", text)):
        paths = []
        for item in body.split():
            if not item.startswith(_DIR):
                raise ValueError(f"sources.cmake: {name}: {item!r} does not start with {_DIR}")
            paths.append(prefix + item[len(_DIR) :])
        lists[name] = paths
    return lists


def to_starlark(lists):
    lines = ["# Generated from xla_ext/sources.cmake by bazel/sources_cmake.py; do not edit."]
    for name, paths in lists.items():
        lines.append(f"{name} = {paths!r}")
    lines.append(f"JBPS_SOURCE_LISTS = {sorted(lists)!r}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.stdout.write(to_starlark(parse(f.read())))
