"""Static plans of a psum: which bytes go where, under which key, how soon."""

from .assign import COLOCATED, DEDICATED, ROLES, assign_chunks, server_fractions
from .plan import SUPPORTED_DTYPES, CallPlan, LeafPlan, check_dtypes, chunk_size, leaf_key, make_plan
from .priority import forward_order, resolve_priorities
from .split import Split, allreduce_time_s, optimal_split, ps_time_s

__all__ = [
    "COLOCATED",
    "DEDICATED",
    "ROLES",
    "SUPPORTED_DTYPES",
    "CallPlan",
    "LeafPlan",
    "Split",
    "allreduce_time_s",
    "assign_chunks",
    "check_dtypes",
    "chunk_size",
    "forward_order",
    "leaf_key",
    "make_plan",
    "optimal_split",
    "ps_time_s",
    "resolve_priorities",
    "server_fractions",
]
