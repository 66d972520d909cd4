"""Bad input gets a clear error naming what is at fault, and nothing hangs."""

import re
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbps
from jbps import _core
from conftest import job_free_env, last_json, run_job, worker_script


@pytest.mark.parametrize(
    "what,tensor,mine,theirs",
    [
        ("shape", "b", "float32[2,3]", "float32[7]"),
        ("dtype", "b", "float32[2,3]", "float16[2,3]"),
        ("layout", "b", "float32[2,3]", "float32[3,2]"),  # the same bytes: only the tree check sees it
        ("leaves", "c", "nothing", "float32[4]"),  # and its routing of 'a' and 'b' may differ
    ],
)
def test_workers_disagreeing_on_a_tensor_all_raise_naming_it(what, tensor, mine, theirs):
    results = run_job(
        [worker_script("mismatch.py"), "--what", what], workers=2, servers=2, env={"JBPS_TIMEOUT_S": "20"}
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        rep = last_json(r.stdout)
        assert rep["error"] is not None, f"worker {r.rank} got no error but a sum: {rep['sum']}"
        assert f"mismatched['{tensor}']" in rep["error"], rep["error"]
        assert f"has {mine}" in rep["error"] and theirs in rep["error"], rep["error"]
        assert "disagree" in rep["error"]
        assert "timed out" not in rep["error"]
        assert rep["recovered"], f"worker {r.rank} could not psum after the failed call"


@pytest.mark.parametrize(
    "what,tensor,mine,theirs",
    [
        ("layout", "b", "float32[2,3]", "float32[3,2]"),
        ("leaves", "c", "nothing", "float32[4]"),
    ],
)
def test_workers_disagreeing_after_agreeing_all_raise_naming_it(what, tensor, mine, theirs):
    # The servers know worker 0's tree from the calls before: its check sends the digest alone.
    results = run_job(
        [worker_script("mismatch.py"), "--what", what, "--good-calls", "3"],
        workers=2,
        servers=2,
        env={"JBPS_TIMEOUT_S": "20"},
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        rep = last_json(r.stdout)
        assert rep["error"] is not None, f"worker {r.rank} got no error but a sum: {rep['sum']}"
        assert f"mismatched['{tensor}']" in rep["error"] and f"has {mine}" in rep["error"], rep["error"]
        assert theirs in rep["error"] and "timed out" not in rep["error"], rep["error"]
        assert rep["recovered"]


def test_workers_cutting_a_tree_into_different_chunks_all_raise_at_once():
    # The same tree, so the tree check finds nothing to name; the chunks'
    # sizes differ, which the servers see at the first push and say at once.
    timeout_s = 20
    results = run_job(
        [worker_script("mismatch.py"), "--what", "chunks"],
        workers=2,
        servers=2,
        env={"JBPS_TIMEOUT_S": str(timeout_s)},
        env_per_rank={1: {"JBPS_PARTITION_BYTES": "64K"}},
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        rep = last_json(r.stdout)
        assert rep["error"] is not None, f"worker {r.rank} got no error but a sum: {rep['sum']}"
        assert "mismatched['a']" in rep["error"] and "different chunks" in rep["error"], rep["error"]
        assert "JBPS_PARTITION_BYTES" in rep["error"], rep["error"]
        assert rep["seconds"] < timeout_s / 4, rep
        assert rep["recovered"], f"worker {r.rank} could not psum after the failed call"


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_fails_init_within_timeout_naming_it():
    addr = f"127.0.0.1:{closed_port()}"
    start = time.monotonic()
    with pytest.raises(jbps.JbpsError, match=addr):
        jbps.init(servers=[addr], num_workers=1, worker_rank=0, timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert not jbps.is_initialized()


def test_silent_peer_fails_init_within_timeout_naming_it():
    # Something listens but never speaks the protocol.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        addr = "127.0.0.1:%d" % s.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(jbps.JbpsError, match=addr):
            jbps.init(servers=[addr], num_workers=1, worker_rank=0, timeout_s=1.0)
        assert time.monotonic() - start < 5


def test_wrong_job_token_is_refused():
    srv = _core.Server("127.0.0.1:0", 1, token=1234)
    try:
        with pytest.raises(jbps.JbpsError, match=f"127.0.0.1:{srv.port}"):
            jbps.init(servers=[f"127.0.0.1:{srv.port}"], num_workers=1, worker_rank=0, timeout_s=2.0, job_token=99)
        with jbps.init(servers=[f"127.0.0.1:{srv.port}"], num_workers=1, worker_rank=0, timeout_s=2.0, job_token=1234):
            assert float(jax.jit(lambda x: jbps.psum(x))(jnp.float32(2))) == 2.0
        assert srv.stats()["rejected"] >= 1
    finally:
        srv.stop()


def test_server_disagreeing_on_worker_count_is_reported():
    srv = _core.Server("127.0.0.1:0", 3)
    try:
        with pytest.raises(jbps.JbpsError, match="--num-workers 3"):
            jbps.init(servers=[f"127.0.0.1:{srv.port}"], num_workers=2, worker_rank=0, timeout_s=2.0)
    finally:
        srv.stop()


def test_psum_before_init_is_a_clear_error():
    assert not jbps.is_initialized()
    with pytest.raises(jbps.JbpsError, match="jbps.init"):
        jax.jit(lambda x: jbps.psum(x))(jnp.ones(3))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.uint32, jnp.int64])
def test_unsupported_dtype_is_a_type_error_naming_the_leaf(session, dtype):
    if dtype == jnp.int64 and not jax.config.jax_enable_x64:
        pytest.skip("int64 arrays need jax_enable_x64")
    tree = {"ok": jnp.ones(2), "layer": {"bad": jnp.zeros(3, dtype)}}
    with pytest.raises(TypeError, match=r"\['layer'\]\['bad'\].*" + np.dtype(dtype).name):
        jax.jit(lambda t: jbps.psum(t))(tree)


def test_a_missing_worker_times_out_naming_the_tensor_and_server():
    # The server expects 2 workers; only this one comes.
    srv = _core.Server("127.0.0.1:0", 2)
    addr = f"127.0.0.1:{srv.port}"
    try:
        with jbps.init(servers=[addr], num_workers=2, worker_rank=0, timeout_s=1.5):
            start = time.monotonic()
            with pytest.raises(Exception, match=r"timed out.*lonely\['x'\].*" + addr):
                jax.block_until_ready(jax.jit(lambda t: jbps.psum(t, name="lonely"))({"x": jnp.ones(4)}))
            assert time.monotonic() - start < 10
    finally:
        srv.stop()


def test_a_timeout_names_the_worker_that_has_not_pushed():
    # Worker 1 never comes; the server has waited half its timeout when worker
    # 0's psum times out, and has told worker 0 which worker it waits for.
    srv = _core.Server("127.0.0.1:0", 2, timeout_s=4.0)
    addr = f"127.0.0.1:{srv.port}"
    try:
        with jbps.init(servers=[addr], num_workers=2, worker_rank=0, timeout_s=4.0):
            with pytest.raises(Exception) as caught:
                jax.block_until_ready(jax.jit(lambda t: jbps.psum(t, name="lonely"))({"x": jnp.ones(4)}))
            message = str(caught.value)
            assert re.search(
                r"timed out after 4 s .*: worker 1 has not pushed tensor 'lonely\['x'\]' \(round 0\) to server "
                + re.escape(addr)
                + r", which had waited [0-9.]+ s for it",
                message,
            ), message
            assert message.count("jbps:") == 1, message
    finally:
        srv.stop()


def test_bad_configuration_names_the_variable(monkeypatch):
    monkeypatch.setenv("JBPS_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("JBPS_NUM_WORKERS", "zero")
    with pytest.raises(jbps.JbpsError, match="JBPS_NUM_WORKERS"):
        jbps.init()
    monkeypatch.setenv("JBPS_NUM_WORKERS", "2")
    monkeypatch.setenv("JBPS_WORKER_RANK", "2")
    with pytest.raises(jbps.JbpsError, match="out of range"):
        jbps.init()
    monkeypatch.delenv("JBPS_SERVERS")
    with pytest.raises(jbps.JbpsError, match="JBPS_SERVERS"):
        jbps.init()
    with pytest.raises(TypeError, match="unknown option"):
        jbps.init(server="127.0.0.1:1")


@pytest.mark.parametrize(
    "argv,env,needle",
    [
        (["--num-workers", "0"], {}, "--num-workers"),
        (["--num-workers", "1", "--token", str(1 << 65)], {}, "--token"),
        ([], {}, "--num-workers is required"),
    ],
)
def test_server_command_line_names_the_bad_flag(argv, env, needle):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "jbps.server", *argv],
        env=job_free_env(**env),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr


@pytest.mark.parametrize(
    "module,argv,env,line",
    [
        ("jbps.server", ["--num-workers", "1"], {"JBPS_TIMEOUT_S": "-3"}, "JBPS_TIMEOUT_S='-3': must be positive"),
        ("jbps.server", [], {"DMLC_NUM_WORKER": "many"}, "DMLC_NUM_WORKER='many': 'many' is not a whole number"),
        (
            "jbps.server",
            ["--num-workers", "1"],
            {"JBPS_SERVER_ENGINE_THREADS": "lots"},
            "JBPS_SERVER_ENGINE_THREADS='lots': must be a whole number of threads (0: min(4, cores))",
        ),
        (
            "jbps.server",
            ["--num-workers", "1"],
            {"JBPS_SERVER_ROLE": "boss"},
            "JBPS_SERVER_ROLE='boss': expected one of colocated, dedicated",
        ),
        (
            "jbps.scheduler",
            [],
            {"JBPS_TIMEOUT_S": "soon"},
            "JBPS_TIMEOUT_S='soon': 'soon' is not a number (of seconds, e.g. 60 or 2.5)",
        ),
    ],
)
def test_a_bad_environment_variable_is_one_line_naming_it_without_usage(module, argv, env, line):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", module, *argv],
        env=job_free_env(**env),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == f"python -m {module}: {line}", out.stderr  # no flag was wrong: no usage


@pytest.mark.parametrize(
    "text,nbytes",
    [("4194304", 4 << 20), ("4M", 4 << 20), ("4MiB", 4 << 20), ("4 MiB", 4 << 20), ("64K", 64 << 10), ("1g", 1 << 30)],
)
def test_sizes_are_written_with_units(text, nbytes):
    env = {"JBPS_PARTITION_BYTES": text}
    assert jbps.Config.resolve({}, env).partition_bytes == nbytes
    assert jbps.Config.resolve({"partition_bytes": text}, {}).partition_bytes == nbytes
    assert jbps.Config.resolve({}, {"BYTEPS_PARTITION_BYTES": text}).partition_bytes == nbytes


@pytest.mark.parametrize("text", ["4X", "four", "-1", "1.5M", "0"])
def test_a_bad_size_says_the_accepted_form(text):
    with pytest.raises(jbps.JbpsError) as info:
        jbps.Config.resolve({}, {"JBPS_PARTITION_BYTES": text})
    message = str(info.value)
    assert message.startswith(f"JBPS_PARTITION_BYTES={text!r}: "), message
    assert "64K, 4M, 1G" in message or message.endswith("must be at least 1 byte"), message


def test_bad_priority_is_an_error_at_trace_time_naming_the_leaf(session):
    tree = {"a": jnp.ones(3), "b": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"\['c'\]"):
        jax.jit(lambda t: jbps.psum(t, priority={"['c']": 1}))(tree)
    with pytest.raises(TypeError, match=r"\['b'\]"):
        jax.jit(lambda t: jbps.psum(t, priority=lambda path, leaf: "high" if "b" in path else 0))(tree)
