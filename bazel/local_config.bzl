"""Repository rule @jbps_local_config: the build inputs that come from what is
installed, never from the network. It runs the configured Python (JBPS_PYTHON,
else PYTHON_BIN_PATH, else python3 on PATH) to find its headers, nanobind's
sources and the XLA FFI headers (jax.ffi.include_dir(), or JBPS_FFI_INCLUDE_DIR),
links them into the repository, and turns xla_ext/sources.cmake into
sources.bzl so that Bazel compiles the files CMake compiles."""

_ENV = ["JBPS_PYTHON", "PYTHON_BIN_PATH", "JBPS_FFI_INCLUDE_DIR", "PATH"]

def _python(ctx):
    for var in ["JBPS_PYTHON", "PYTHON_BIN_PATH"]:
        if ctx.os.environ.get(var):
            return ctx.os.environ[var]
    found = ctx.which("python3")
    if not found:
        fail("jbps bazel: no python3 on PATH; set JBPS_PYTHON to a Python with jax and nanobind")
    return str(found)

def _run(ctx, args, what):
    result = ctx.execute(args, environment = {"PYTHONNOUSERSITE": "1"})
    if result.return_code != 0:
        fail("jbps bazel: %s failed (%s):\n%s%s" % (what, " ".join([str(a) for a in args]), result.stdout, result.stderr))
    return result.stdout

def _impl(ctx):
    python = _python(ctx)
    deps = json.decode(_run(ctx, [python, ctx.path(Label("//bazel:find_deps.py"))], "finding installed build inputs"))
    ctx.symlink(deps["python_include"], "python_include")
    ctx.symlink(deps["nanobind_src"], "nanobind/src")
    ctx.symlink(deps["nanobind_include"], "nanobind/include")
    ctx.symlink(deps["robin_map_include"], "robin_map_include")
    ctx.symlink(deps["ffi_include"], "ffi_include")
    sources = _run(ctx, [
        python,
        ctx.path(Label("//bazel:sources_cmake.py")),
        ctx.path(Label("//:xla_ext/sources.cmake")),
    ], "reading xla_ext/sources.cmake")
    ctx.file("sources.bzl", sources)
    ctx.template("BUILD.bazel", Label("//bazel:local_config.BUILD"), {"%{python}": deps["python"]})

jbps_local_config = repository_rule(
    implementation = _impl,
    environ = _ENV,
    local = True,
)
