"""The CMake and Bazel builds compile the same xla_ext sources.

Both take their files from the JBPS_*_SOURCES lists of xla_ext/sources.cmake
(Bazel through bazel/sources_cmake.py, imported here so the test reads the lists
exactly as Bazel does). Lists whose name contains CUDA are CMake-only: the
Bazel build has no CUDA toolchain.
"""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = (".cc", ".cpp", ".cu")

_spec = importlib.util.spec_from_file_location("sources_cmake", REPO / "bazel" / "sources_cmake.py")
sources_cmake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sources_cmake)


def lists():
    return sources_cmake.parse((REPO / "xla_ext" / "sources.cmake").read_text())


def cmake_lists():
    text = (REPO / "CMakeLists.txt").read_text()
    return {name for name in lists() if "${" + name + "}" in text}


def bazel_lists():
    # A list counts when BUILD.bazel loads it from sources.bzl and uses it.
    text = (REPO / "BUILD.bazel").read_text()
    load = re.search(r'load\("@jbps_local_config//:sources\.bzl",(.*?)\)', text, re.S)
    loaded = set(re.findall(r'"(\w+)"', load.group(1))) if load else set()
    body = text.replace(load.group(0), "") if load else text
    return {name for name in lists() if name in loaded and re.search(rf"\b{name}\b", body)}


def files_of(names):
    return {path: name for name, paths in lists().items() if name in names for path in paths}


def test_every_source_file_is_in_a_list_and_exists():
    listed = files_of(lists())
    on_disk = {p.relative_to(REPO).as_posix() for p in (REPO / "xla_ext").rglob("*") if p.suffix in SOURCE_SUFFIXES}
    assert not on_disk - listed.keys(), (
        f"in neither build (add to xla_ext/sources.cmake): {sorted(on_disk - listed.keys())}"
    )
    assert not listed.keys() - on_disk, (
        f"listed in xla_ext/sources.cmake but missing: {sorted(listed.keys() - on_disk)}"
    )


def test_cmake_and_bazel_build_the_same_files():
    cmake, bazel = files_of(cmake_lists()), files_of(bazel_lists())
    cuda_only = {p for p, name in cmake.items() if "CUDA" in name}
    only_cmake = sorted(f"{p} ({cmake[p]})" for p in cmake.keys() - bazel.keys() - cuda_only)
    only_bazel = sorted(f"{p} ({bazel[p]})" for p in bazel.keys() - cmake.keys())
    assert not only_cmake, f"built by CMake but not by Bazel (use the list in BUILD.bazel): {only_cmake}"
    assert not only_bazel, f"built by Bazel but not by CMake (use the list in CMakeLists.txt): {only_bazel}"
    unused = sorted(set(lists()) - cmake_lists())
    assert not unused, f"lists of xla_ext/sources.cmake that CMakeLists.txt does not build: {unused}"


@pytest.mark.parametrize("build_file", ["CMakeLists.txt", "BUILD.bazel"])
def test_build_files_name_no_source_outside_the_lists(build_file):
    # A file may be named for its flags (the FFI handler's -fpermissive), never added by hand.
    named = set(
        re.findall(
            r"xla_ext/[\w/]+(?:" + "|".join(map(re.escape, SOURCE_SUFFIXES)) + r")\b", (REPO / build_file).read_text()
        )
    )
    built = files_of(cmake_lists() if build_file == "CMakeLists.txt" else bazel_lists())
    assert not named - built.keys(), (
        f"{build_file} names sources that are not in its lists: {sorted(named - built.keys())}"
    )


def test_every_sources_list_is_parsed():
    # Lists added later (e.g. a CUDA handler's) are read like the others.
    text = """set(JBPS_CORE_SOURCES
      ${CMAKE_CURRENT_LIST_DIR}/a.cc  # comment
    )
    set(JBPS_CUDA_SOURCES ${CMAKE_CURRENT_LIST_DIR}/b.cu ${CMAKE_CURRENT_LIST_DIR}/sub/c.cc)"""
    assert sources_cmake.parse(text) == {
        "JBPS_CORE_SOURCES": ["xla_ext/a.cc"],
        "JBPS_CUDA_SOURCES": ["xla_ext/b.cu", "xla_ext/sub/c.cc"],
    }
    with pytest.raises(ValueError, match="JBPS_X_SOURCES"):
        sources_cmake.parse("set(JBPS_X_SOURCES /abs/d.cc)")
