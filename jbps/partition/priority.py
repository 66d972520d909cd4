"""Leaf priorities: larger is sent sooner.

By default a psum's leaves go in pytree order, first leaf first (priority
-index), because the next forward pass needs the first layer first. jax
flattens dicts in *sorted key* order, so for flax params the default is the
alphabetical order of module names ('Dense_0', 'Dense_1', 'Dense_10',
'Dense_2', ...), which is not always the order the layers run in.
`forward_order(params)` recovers that order from the dict insertion order
flax's init produces (modules are created as the forward pass calls them);
pass its result as `jbps.psum(..., priority=...)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

Priority = Mapping[str, int] | Callable[[str, Any], int] | None


def _level_position(node: Any, entry: Any, tree_util: Any) -> tuple[int, Any] | None:
    """Position of `entry` among its siblings in creation order, and the child."""
    if isinstance(entry, tree_util.DictKey) and isinstance(node, Mapping):
        return list(node.keys()).index(entry.key), node[entry.key]
    if isinstance(entry, tree_util.SequenceKey):
        return entry.idx, node[entry.idx]
    if isinstance(entry, tree_util.GetAttrKey):
        if dataclasses.is_dataclass(node):
            names = [f.name for f in dataclasses.fields(node)]
        else:
            names = list(getattr(node, "_fields", ()))  # namedtuple
        if entry.name in names:
            return names.index(entry.name), getattr(node, entry.name)
    return None


def forward_order(tree: Any) -> dict[str, int]:
    """{leaf path: priority} with dicts taken in insertion order, the first
    leaf highest. For flax, call it on the params that `init` returned."""
    from jax import tree_util  # here, not above: importing jbps loads no jax (servers, the scheduler)

    path_leaves = tree_util.tree_flatten_with_path(tree)[0]
    ranks = []
    for flat_index, (path, _) in enumerate(path_leaves):
        node, position = tree, []
        for entry in path:
            found = _level_position(node, entry, tree_util)
            if found is None:
                break  # an unknown container: keep jax's order below it
            index, node = found
            position.append(index)
        ranks.append((tuple(position), flat_index))
    order = sorted(range(len(path_leaves)), key=lambda i: ranks[i])
    return {tree_util.keystr(path_leaves[i][0]): -rank for rank, i in enumerate(order)}


def _check(value: Any, path: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"{what}: priority of leaf {path or '<root>'} must be an integer, got {value!r}")
    value = int(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{what}: priority of leaf {path or '<root>'} does not fit in 64 bits: {value}")
    return value


def resolve_priorities(
    paths: Sequence[str], leaves: Sequence[Any], priority: Priority, what: str = "jbps.psum"
) -> list[int] | None:
    """One priority per leaf from a mapping {path: int} (leaves not named keep
    the default, -index) or a callable (path, leaf) -> int; None keeps the
    default for every leaf."""
    if priority is None:
        return None
    if isinstance(priority, Mapping):
        unknown = sorted(set(priority) - set(paths))
        if unknown:
            raise ValueError(
                f"{what}: priority names leaves that are not in the tree: {unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''}; the tree's leaves are {list(paths)[:5]}"
                f"{' ...' if len(paths) > 5 else ''}"
            )
        return [_check(priority[p], p, what) if p in priority else -i for i, p in enumerate(paths)]
    if callable(priority):
        return [_check(priority(p, leaf), p, what) for p, leaf in zip(paths, leaves)]
    raise TypeError(
        f"{what}: priority must be a mapping {{leaf path: int}} or a callable (path, leaf) -> int, "
        f"got {type(priority).__name__}"
    )
