"""Static plans of a psum: which bytes go where, under which key, how soon."""

from .plan import SUPPORTED_DTYPES, LeafPlan, check_dtypes, leaf_key, make_plan

__all__ = ["SUPPORTED_DTYPES", "LeafPlan", "check_dtypes", "leaf_key", "make_plan"]
