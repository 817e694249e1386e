"""Dense-side mesh and layout: ``me.Mesh``, ``me.Layout``, ``me.UNSHARDED``.

These mirror Keras DTensor's ``Mesh``/``Layout`` but stay backend-neutral: a ``Mesh`` asks
its backend for the real mesh object (``jax.sharding.Mesh``, torch ``DeviceMesh``, or
``None`` for NumPy's logical shards) and a ``Layout`` is pure data the backend turns into
its own sharding (``NamedSharding``, DTensor placements) in ``Backend.place``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from meshembed.errors import ConfigError

#: Sharding spec of a tensor axis that is not split over any mesh dimension (Keras' value).
UNSHARDED = "unsharded"

__all__ = ["UNSHARDED", "Layout", "Mesh"]


class Mesh:
    """A named grid of devices (or ranks) that layouts refer to.

    ``native`` is the backend's own mesh, created once here so every variable and slot on
    this mesh shares the same device assignment.
    """

    def __init__(
        self,
        dim_names: Sequence[str],
        shape: Sequence[int],
        devices: Any = None,
        backend: Any = None,
    ) -> None:
        from meshembed.backend import get_backend

        if isinstance(dim_names, str) or not all(isinstance(n, str) and n for n in dim_names):
            raise ConfigError(
                "Invalid `dim_names`. Expected a sequence of non-empty strings. "
                f"Received: dim_names={dim_names!r}"
            )
        dim_names = tuple(dim_names)
        if len(set(dim_names)) != len(dim_names) or UNSHARDED in dim_names:
            raise ConfigError(
                f"Invalid `dim_names`. Expected unique names other than {UNSHARDED!r}. "
                f"Received: dim_names={dim_names!r}"
            )
        try:
            shape = tuple(int(s) for s in shape)
        except TypeError:
            raise ConfigError(f"Invalid `shape`. Expected a sequence of ints. Received: shape={shape!r}") from None
        if len(shape) != len(dim_names) or any(s < 1 for s in shape):
            raise ConfigError(
                f"Invalid `shape`. Expected {len(dim_names)} positive ints (one per name in "
                f"dim_names={dim_names!r}). Received: shape={shape!r}"
            )
        self.dim_names: tuple[str, ...] = dim_names
        self.shape: tuple[int, ...] = shape
        self.backend = get_backend(backend)
        self.native: Any = self.backend.make_mesh(dim_names, shape, devices)

    @property
    def size(self) -> int:
        """Number of devices (ranks) in the mesh."""
        return math.prod(self.shape)

    def dim_size(self, name: str) -> int:
        if name not in self.dim_names:
            raise ConfigError(
                f"Invalid mesh dimension. Expected one of {list(self.dim_names)}. Received: {name!r}"
            )
        return self.shape[self.dim_names.index(name)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return (
            self.dim_names == other.dim_names
            and self.shape == other.shape
            and self.backend.name == other.backend.name
            and (self.native is other.native or self.native == other.native)
        )

    def __hash__(self) -> int:
        return hash((self.dim_names, self.shape, self.backend.name))

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"Mesh({dims}, backend={self.backend.name!r})"


class Layout:
    """How each axis of a tensor is split over the mesh: one spec per axis, either a mesh
    dimension name or ``UNSHARDED``. A mesh dimension shards at most one axis; mesh
    dimensions not named are replicated over."""

    def __init__(self, sharding_specs: Sequence[str], mesh: Mesh) -> None:
        if not isinstance(mesh, Mesh):
            raise ConfigError(f"Invalid `mesh`. Expected a meshembed.Mesh. Received: mesh={mesh!r}")
        if isinstance(sharding_specs, str):
            raise ConfigError(
                "Invalid `sharding_specs`. Expected a sequence with one entry per tensor axis. "
                f"Received: sharding_specs={sharding_specs!r}"
            )
        specs = tuple(sharding_specs)
        allowed = {UNSHARDED, *mesh.dim_names}
        for s in specs:
            if s not in allowed:
                raise ConfigError(
                    f"Invalid `sharding_specs`. Expected each entry in {sorted(allowed)}. "
                    f"Received: sharding_specs={list(specs)!r}"
                )
        used = [s for s in specs if s != UNSHARDED]
        if len(set(used)) != len(used):
            raise ConfigError(
                "Invalid `sharding_specs`. Expected each mesh dimension at most once. "
                f"Received: sharding_specs={list(specs)!r}"
            )
        self.sharding_specs: tuple[str, ...] = specs
        self.mesh = mesh

    @classmethod
    def replicated(cls, mesh: Mesh, rank: int) -> "Layout":
        """Every device holds the whole tensor (scalars, iteration counters)."""
        return cls([UNSHARDED] * int(rank), mesh)

    @classmethod
    def batch_sharded(cls, mesh: Mesh, batch_dim: str, rank: int, axis: int = 0) -> "Layout":
        """Axis ``axis`` split over mesh dimension ``batch_dim``, the rest replicated."""
        specs = [UNSHARDED] * int(rank)
        if not 0 <= axis < rank:
            raise ConfigError(f"Invalid `axis`. Expected 0 <= axis < rank={rank}. Received: axis={axis}")
        specs[axis] = batch_dim
        return cls(specs, mesh)

    @property
    def rank(self) -> int:
        return len(self.sharding_specs)

    @property
    def is_fully_replicated(self) -> bool:
        return all(s == UNSHARDED for s in self.sharding_specs)

    def num_shards(self, axis: int) -> int:
        """How many pieces axis ``axis`` is cut into."""
        spec = self.sharding_specs[axis]
        return 1 if spec == UNSHARDED else self.mesh.dim_size(spec)

    def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Per-device shape of a tensor of global ``shape`` (the logical shard on NumPy)."""
        self.check_shape(shape)
        return tuple(int(d) // self.num_shards(i) for i, d in enumerate(shape))

    def device_coordinates(self) -> list[tuple[int, ...]]:
        """Mesh coordinates of every device, row-major (the order of ``shard``'s pieces)."""
        return [tuple(int(i) for i in c) for c in np.ndindex(*self.mesh.shape)]

    def shard(self, value: Any) -> list[np.ndarray]:
        """The piece of a global NumPy ``value`` each device holds (NumPy's logical shards),
        in ``device_coordinates`` order; replicated mesh dimensions repeat a piece."""
        value = np.asarray(value)
        local = self.shard_shape(value.shape)
        pieces = []
        for coord in self.device_coordinates():
            index = []
            for axis, spec in enumerate(self.sharding_specs):
                k = 0 if spec == UNSHARDED else coord[self.mesh.dim_names.index(spec)]
                index.append(slice(k * local[axis], (k + 1) * local[axis]))
            pieces.append(value[tuple(index)])
        return pieces

    def unshard(self, pieces: Sequence[Any]) -> np.ndarray:
        """Inverse of :meth:`shard`: the global array from the per-device pieces."""
        pieces = [np.asarray(p) for p in pieces]
        coords = self.device_coordinates()
        if len(pieces) != len(coords):
            raise ConfigError(f"Invalid `pieces`. Expected {len(coords)} (one per device). Received: {len(pieces)}")
        local = pieces[0].shape
        shape = tuple(d * self.num_shards(i) for i, d in enumerate(local))
        out = np.empty(shape, dtype=pieces[0].dtype)
        for coord, piece in zip(coords, pieces):
            index = []
            for axis, spec in enumerate(self.sharding_specs):
                k = 0 if spec == UNSHARDED else coord[self.mesh.dim_names.index(spec)]
                index.append(slice(k * local[axis], (k + 1) * local[axis]))
            out[tuple(index)] = piece
        return out

    def check_shape(self, shape: Sequence[int]) -> None:
        """Raise unless ``shape`` has this rank and each sharded axis divides evenly."""
        shape = tuple(int(d) for d in shape)
        if len(shape) != self.rank:
            raise ConfigError(
                f"Invalid `layout`. Expected rank {len(shape)} to match the value's shape "
                f"{shape}. Received: layout={self!r}"
            )
        for i, d in enumerate(shape):
            n = self.num_shards(i)
            if d % n:
                raise ConfigError(
                    f"Invalid `layout`. Expected axis {i} (size {d}) to divide evenly over "
                    f"{n} shards of mesh dimension {self.sharding_specs[i]!r}. Received: layout={self!r}"
                )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self.sharding_specs == other.sharding_specs and self.mesh == other.mesh

    def __hash__(self) -> int:
        return hash((self.sharding_specs, self.mesh))

    def __repr__(self) -> str:
        return f"Layout({list(self.sharding_specs)!r}, {self.mesh!r})"
