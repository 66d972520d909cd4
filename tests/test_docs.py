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
