"""Under mpirun: rank 0 calls jbps.init(), the others never do (they sleep).
jbps must not wait forever: after JBPS_TIMEOUT_S it aborts the MPI job."""

import time

from mpi4py import MPI

import jbps

if MPI.COMM_WORLD.rank == 0:
    jbps.init()
else:
    time.sleep(120)
