"""A keep-alive server between jobs: a worker of the next job may reconnect before the
server has read its goodbye from the last one. It must be admitted into the next job,
not refused as "already connected" nor mixed into the job still ending."""

import socket

import numpy as np

import jbps
from jbps import _core
from wire import HEADER, HELLO, HELLO_OK, BYE
from wire import frame as _frame

TOKEN = 0xA11CE


def frame(type_, sender=0, key=0):
    return _frame(type_, TOKEN, key=key, sender=sender)


def join(port, rank):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(frame(HELLO, sender=rank, key=2))
    return s


def answer(s):
    return HEADER.unpack(s.recv(HEADER.size, socket.MSG_WAITALL))[2]


def test_a_worker_back_before_its_goodbye_is_read_joins_the_next_job():
    srv = _core.Server("127.0.0.1:0", 2, token=TOKEN, keep_alive=True, timeout_s=10)
    try:
        for _ in range(20):
            first = {rank: join(srv.port, rank) for rank in (0, 1)}
            assert [answer(s) for s in first.values()] == [HELLO_OK, HELLO_OK]
            # Rank 0 says goodbye and is back at once, while rank 1 is still in the old job.
            first[0].sendall(frame(BYE))
            again = join(srv.port, 0)
            first[0].close()
            assert answer(again) == HELLO_OK
            first[1].sendall(frame(BYE))
            first[1].close()
            again.sendall(frame(BYE))
            again.close()
        assert srv.stats()["rejected"] == 0
    finally:
        srv.stop()


def test_jobs_back_to_back_on_one_keep_alive_server():
    srv = _core.Server("127.0.0.1:0", 1, token=TOKEN, keep_alive=True, timeout_s=10)
    try:
        import jax

        for job in range(3):
            with jbps.init(
                servers=[f"127.0.0.1:{srv.port}"], num_workers=1, worker_rank=0, job_token=TOKEN, timeout_s=20
            ):
                x = np.arange(1000, dtype=np.float32) * (job + 1)
                np.testing.assert_array_equal(jax.jit(lambda t: jbps.psum(t, name="job"))(x), x)
    finally:
        srv.stop()
