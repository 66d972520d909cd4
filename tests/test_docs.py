"""The documentation a user has: the README points at docs/design.md, which
ships with the checkout, and nothing points at files outside it."""

import os
import re

import pytest

from jbps import optimal_split

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(CHECKOUT, "docs", "design.md")
SOURCES = ("README.md", "jbps", "xla_ext", "examples", "bazel", "tests", "docs")


def _files():
    for top in SOURCES:
        path = os.path.join(CHECKOUT, top)
        if os.path.isfile(path):
            yield path
        for folder, _, names in os.walk(path):
            for name in names:
                if name.endswith((".py", ".md", ".cc", ".h", ".bzl", ".txt", ".cmake", ".sh")):
                    yield os.path.join(folder, name)


def test_the_readme_points_at_the_design_page_which_exists():
    readme = open(os.path.join(CHECKOUT, "README.md")).read()
    assert "](docs/design.md" in readme
    assert os.path.isfile(DESIGN)


def test_nothing_points_at_design_notes_outside_the_checkout():
    here = os.path.abspath(__file__)
    found = [
        path
        for path in _files()
        if path != here and re.search(r"DESIGN\.md|\.\./shared", open(path, errors="replace").read())
    ]
    assert found == []


@pytest.mark.parametrize("n,k", [(4, 2)])
def test_the_design_pages_worked_example_is_what_jbps_computes(n, k):
    text = open(DESIGN).read()
    split = optimal_split(n, k)
    assert f"x = 6/20 = {split.cpu_fraction:g}" in text and f"y = 2/20 = {split.colocated_fraction:g}" in text
    assert f"T = {split.time_s(1, 1):.1f}·M/B" in text


# Every command the docs show, parsed by the program it names (without running it).
DOC_FILES = [os.path.join(CHECKOUT, "README.md")] + sorted(
    os.path.join(folder, name)
    for folder, _, names in os.walk(os.path.join(CHECKOUT, "docs"))
    if "_build" not in folder
    for name in names
    if name.endswith(".md")
)
# Placeholders and shell syntax a command line shown as a pattern has: such lines are not commands.
PATTERN_MARKS = ("[", "...", "<", "|", "HOST", "PORT", "..", "{", "$")


class Parsed(Exception):
    """Raised by the patched parse_args once a program's arguments parsed."""


def _command_lines(text):
    """Command lines: indented or fenced code lines (inline code spans name
    commands and options in prose more often than they show one to run)."""
    in_fence = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence or line.startswith("    "):
            yield line.strip()


def _commands(text):
    """(argv, shown) for each concrete jbps / python -m / python examples command shown."""
    for line in _command_lines(text):
        line = re.sub(r"\s+#.*$", "", line).rstrip(" &")
        for part in re.split(r"\s*(?:&&|;)\s*", line):
            words = part.split()
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
                words.pop(0)
            if not words or any(mark in part for mark in PATTERN_MARKS):
                continue
            if words[0] == "jbps" or (words[0] == "python" and len(words) > 2 and words[1] == "-m"):
                yield words, part
                if words[:2] == ["jbps", "run"] and "python" in words:  # and the program it runs
                    yield from _commands("    " + " ".join(words[words.index("python") :]))
            elif words[0] == "python" and len(words) > 1 and words[1].startswith("examples/"):
                yield words, part


def _parse_only(words):
    """Runs the program `words` names up to its argument parsing; raises Parsed
    when that succeeds, SystemExit when its parser refuses the arguments."""
    import argparse
    import runpy
    import sys
    from unittest import mock

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    if words[0] == "jbps":
        from jbps.cli import main

        argv, target = words, lambda: main(words[1:])
    elif words[1] == "-m":
        module = words[2]
        argv, target = [module] + words[3:], lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = os.path.join(CHECKOUT, words[1])
        argv, target = words[1:], lambda: runpy.run_path(script, run_name="__main__")
    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
        mock.patch.object(sys, "argv", argv),
    ):
        target()


def test_every_command_the_docs_show_still_parses():
    shown = {}
    for path in DOC_FILES:
        for words, line in _commands(open(path).read()):
            shown.setdefault(tuple(words), (os.path.relpath(path, CHECKOUT), line))
    assert len(shown) >= 15, f"too few commands found in the docs to check: {sorted(shown)}"
    refused = []
    for words, (where, line) in sorted(shown.items()):
        try:
            _parse_only(list(words))
        except Parsed:
            continue
        except SystemExit as exc:
            if exc.code not in (0, None):  # 0: --help, which parses
                refused.append(f"{where}: `{line}` (exit {exc.code})")
            continue
        except (ImportError, OSError) as exc:  # no such module or script
            refused.append(f"{where}: `{line}`: {exc}")
            continue
        refused.append(f"{where}: `{line}` ran past its argument parsing without parsing")
    assert not refused, "commands in the docs their programs refuse:\n" + "\n".join(refused)


def test_the_docs_build_without_a_warning(tmp_path):
    # What `sphinx-build -W` in CI checks: every page, link and API entry.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(tmp_path / "html")],
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "html" / "api.html").exists()
