"""A leaf's sharding in words another worker rebuilds on its own devices.

An elastic generation starts with every worker taking rank 0's state, each
leaf placed as it was at the last commit (jbps/elastic.py): jax compiles a
step for its inputs' placement, so a worker whose leaves came from the host
would compile its first step for host inputs and its second again for the
step's own outputs, and every other worker waits at that second step. A
newcomer has no commit of its own to place by, so it takes rank 0's: each
leaf's NamedSharding over rank 0's local devices, as the mesh's axis names,
shape, the devices' positions among the local devices, the partition spec
and the axis types (JSON: nothing is unpickled), which every worker can
rebuild on its own local devices, since all have as many.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def to_words(sharding: Any) -> list | None:
    """JSON-able words for a NamedSharding over this process's local devices;
    None for anything else (the host, one device, another kind of sharding)."""
    try:
        return _words(sharding)
    except Exception:  # noqa: BLE001  a mesh this jax describes otherwise: the newcomer places from the host
        return None


def _words(sharding: Any) -> list | None:
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    mesh = sharding.mesh
    positions = {device: i for i, device in enumerate(jax.local_devices())}
    devices = [positions[device] for device in np.asarray(mesh.devices).flat]  # KeyError: another process's
    names = list(mesh.axis_names)
    spec: list = []
    for entry in sharding.spec:
        if entry is None or isinstance(entry, str):
            spec.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(e, str) for e in entry):
            spec.append(list(entry))
        else:
            return None  # e.g. P.UNCONSTRAINED: not one this worker would be given by a step
    if not all(isinstance(n, str) for n in names):
        return None
    axis_types = getattr(mesh, "axis_types", None)
    types = [t.name for t in axis_types] if isinstance(axis_types, tuple) else []
    return [names, list(np.shape(mesh.devices)), devices, spec, types, sharding.memory_kind]


def from_words(words: list | None) -> Any:
    """The NamedSharding `words` describe, on this process's local devices;
    None where they describe none, or one this process cannot hold."""
    if not words:
        return None
    try:
        names, shape, devices, spec, types, memory_kind = words
        local = jax.local_devices()
        if any(not 0 <= i < len(local) for i in devices):
            return None
        kwargs = {"axis_types": tuple(jax.sharding.AxisType[t] for t in types)} if types else {}
        grid = np.empty(len(devices), dtype=object)
        grid[:] = [local[i] for i in devices]
        mesh = jax.sharding.Mesh(grid.reshape(shape), tuple(names), **kwargs)
        entries = (tuple(e) if isinstance(e, list) else e for e in spec)
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries), memory_kind=memory_kind)
    except Exception:  # noqa: BLE001  words this jax cannot rebuild: placed from the host, as before
        return None
