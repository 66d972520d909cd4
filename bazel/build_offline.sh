#!/usr/bin/env bash
# Builds the Bazel targets with no network at all, so that anything Bazel would
# download fails the build instead of passing unnoticed: bazel runs in a new
# network namespace (unshare -n), and with --batch (no Bazel server, which
# would outlive the namespace and talk to its client over loopback).
#
#   bazel/build_offline.sh [bazel build args]     default: //:jbps //bazel:server
#
# JBPS_PYTHON: the Python whose jax (FFI headers) and nanobind are used
# (default: PYTHON_BIN_PATH, else python3); JBPS_FFI_INCLUDE_DIR overrides
# the FFI headers.
set -euo pipefail
cd "$(dirname "$0")/.."
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(//:jbps //bazel:server)
if unshare -n true 2>/dev/null; then
  offline=(unshare -n)
elif unshare -rn true 2>/dev/null; then  # not root: a user namespace grants it
  offline=(unshare -rn)
else
  echo "jbps bazel: unshare -n is not permitted here (needs root or user namespaces); building with the network on" >&2
  offline=()
fi
exec "${offline[@]}" bazel --batch build "${args[@]}"
