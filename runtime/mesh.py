"""The named :class:`DeviceMesh` of a plan, and the process groups the runtime needs from it.

The mesh always has the five axes of :data:`vocab.strategy.MESH_AXES` in that order
(``pp, dp_replicate, dp_shard, cp, tp``), size-1 axes included: slicing a size-1 axis is cheap
and keeps every coordinate well defined. ``ep`` is not an axis of its own (see
:mod:`vocab.strategy`): expert parallelism groups ``ep`` consecutive ranks of ``dp_shard × cp``
(:meth:`RuntimeMesh.expert_mesh`).

Dense states are sharded over ``dp_shard × cp`` (the ``cp`` ranks hold the same parameters and
see other tokens of the same sequences, so their gradients average like data parallelism's), as
the cost model prices them and torchtitan runs them: :meth:`RuntimeMesh.shard_mesh` flattens the
two axes into one (``dp_shard_cp``) when ``cp > 1``. Under TSP the ``tp`` ranks hold other tokens
too: the sequence is cut over ``cp × tp`` ranks (:meth:`RuntimeMesh.seq_group`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from vocab.errors import ShardplanError
from vocab.strategy import MESH_AXES, Mesh

#: axes of :meth:`RuntimeMesh.expert_mesh`
EXPERT_AXES = ("pp", "dp_replicate", "efsdp", "ep", "tp")


def device_type() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(dev: str) -> str:
    return "nccl" if dev == "cuda" else "gloo"


@dataclass
class RuntimeMesh:
    """The plan's mesh on this rank.

    Attributes:
        mesh: the 5-D device mesh named ``pp, dp_replicate, dp_shard, cp, tp``.
        degrees: the plan's degrees, which own every group size (:class:`vocab.strategy.MeshFacts`).
    """

    mesh: DeviceMesh
    degrees: Mesh
    tsp: bool = False  # tp_mode tsp: the tp ranks hold other tokens of the sequence too
    _flat: DeviceMesh | None = field(default=None, init=False, repr=False)
    _seq: DeviceMesh | None = field(default=None, init=False, repr=False)
    _experts: DeviceMesh | None = field(default=None, init=False, repr=False)

    @property
    def device_type(self) -> str:
        return self.mesh.device_type

    @property
    def sizes(self) -> dict[str, int]:
        """Degree of each axis of :attr:`mesh`."""
        return self.degrees.axes()

    @property
    def ep(self) -> int:
        return self.degrees.ep

    def size(self, axis: str) -> int:
        return int(getattr(self.degrees, axis))

    def coord(self, axis: str) -> int:
        """This rank's index along ``axis``."""
        return self.mesh.get_local_rank(axis)

    def sub(self, *axes: str) -> DeviceMesh:
        return self.mesh[axes if len(axes) > 1 else axes[0]]

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh.get_group(axis)

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of the batch: ``dp_replicate × dp_shard``."""
        return self.degrees.dp

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data shard (replica-major), the same on all its TP/PP peers."""
        return self.coord("dp_replicate") * self.degrees.dp_shard + self.coord("dp_shard")

    @property
    def shard_size(self) -> int:
        """Ranks that shard dense states: ``dp_shard × cp``."""
        return self.degrees.shard

    @property
    def expert_shard_size(self) -> int:
        """Ranks that shard expert states: ``dp_shard × cp / ep``."""
        return self.degrees.expert_shard

    @property
    def reduce_size(self) -> int:
        """Ranks whose gradients are averaged: ``dp_replicate × dp_shard × cp``."""
        return self.degrees.dp_all

    @property
    def seq_size(self) -> int:
        """Ranks that hold other tokens of the same sequences: ``cp``, times ``tp`` under TSP."""
        return self.degrees.cp * (self.degrees.tp if self.tsp else 1)

    @property
    def seq_rank(self) -> int:
        """This rank's index among them (``cp``-major: the flattened ``cp × tp`` order)."""
        return self.coord("cp") * (self.degrees.tp if self.tsp else 1) + (self.coord("tp") if self.tsp else 0)

    def seq_group(self) -> dist.ProcessGroup:
        """The group of :attr:`seq_size` ranks: ``cp``, ``tp`` (TSP), or both flattened (``cp_tp``)."""
        if not self.tsp:
            return self.group("cp")
        if self.degrees.cp == 1:
            return self.group("tp")
        if self._seq is None:
            self._seq = self.mesh["cp", "tp"]._flatten("cp_tp")
        return self._seq.get_group()

    def shard_mesh(self) -> DeviceMesh:
        """1-D mesh of the ranks that shard dense states: ``dp_shard``, or ``dp_shard × cp``
        flattened (``dp_shard_cp``) with context parallelism."""
        if self.degrees.cp == 1:
            return self.sub("dp_shard")
        if self._flat is None:
            self._flat = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return self._flat

    def shard_group(self) -> dist.ProcessGroup:
        return self.shard_mesh().get_group()

    def reduce_groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """(shard group, ``dp_replicate`` group), each None where of size 1: the ranks that hold
        other tokens, over which gradients average and MoE loads add up."""
        return (self.shard_group() if self.shard_size > 1 else None,
                self.group("dp_replicate") if self.degrees.dp_replicate > 1 else None)

    def expert_mesh(self) -> DeviceMesh:
        """The ranks as ``(pp, dp_replicate, efsdp, ep, tp)``: the ``dp_shard × cp`` ranks cut into
        expert-parallel groups of ``ep`` consecutive ranks (as the cost model lays them out);
        ``efsdp`` (``dp_shard × cp / ep``) holds the replicas of one EP rank's experts."""
        if self._experts is None:
            d = self.degrees
            shape = (d.pp, d.dp_replicate, d.expert_shard, d.ep, d.tp)
            ranks = torch.arange(dist.get_world_size()).reshape(shape)
            self._experts = DeviceMesh(self.device_type, ranks, mesh_dim_names=EXPERT_AXES)
        return self._experts

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """What shards the experts' states: ``efsdp``, with ``dp_replicate`` for HSDP."""
        mesh = self.expert_mesh()
        return mesh["dp_replicate", "efsdp"] if self.degrees.dp_replicate > 1 else mesh["efsdp"]

    def fsdp_mesh(self) -> DeviceMesh:
        """The 1-D :meth:`shard_mesh`, or for HSDP the 2-D mesh of ``dp_replicate`` and it."""
        flat = self.shard_mesh()
        if self.degrees.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard" if self.degrees.cp == 1 else "dp_shard_cp"]
        return flat

    def tp_mesh(self) -> DeviceMesh:
        return self.sub("tp")


def build_mesh(plan_mesh: Mesh, dev: str | None = None, tsp: bool = False) -> RuntimeMesh:
    """Build the named mesh of ``plan_mesh`` inside an initialised default process group."""
    if not dist.is_initialized():
        raise ShardplanError("apply_plan needs an initialised process group (torch.distributed.init_process_group)")
    world = dist.get_world_size()
    if plan_mesh.world_size != world:
        raise ShardplanError(
            f"the plan's mesh {plan_mesh.axes()} needs {plan_mesh.world_size} processes, "
            f"but the process group has {world}"
        )
    sizes = plan_mesh.axes()
    mesh = init_device_mesh(dev or device_type(), tuple(sizes[a] for a in MESH_AXES), mesh_dim_names=MESH_AXES)
    return RuntimeMesh(mesh=mesh, degrees=plan_mesh, tsp=tsp)


def wrap_mesh(mesh: DeviceMesh | RuntimeMesh, plan_mesh: Mesh, tsp: bool = False) -> RuntimeMesh:
    """A user's mesh as a :class:`RuntimeMesh`, checked against the plan's degrees."""
    if isinstance(mesh, RuntimeMesh):
        rt = mesh
    else:
        if tuple(mesh.mesh_dim_names or ()) != MESH_AXES:
            raise ShardplanError(f"the mesh must have the axes {MESH_AXES} (size-1 ones included), "
                                 f"not {mesh.mesh_dim_names}")
        sizes = dict(zip(MESH_AXES, (int(n) for n in mesh.shape), strict=True))
        if sizes != plan_mesh.axes():
            raise ShardplanError(f"the given mesh {sizes} is not the plan's {plan_mesh.axes()}")
        rt = RuntimeMesh(mesh=mesh, degrees=plan_mesh)
    if rt.sizes != plan_mesh.axes():
        raise ShardplanError(f"the given mesh {rt.sizes} is not the plan's {plan_mesh.axes()}")
    if rt.ep != plan_mesh.ep:
        raise ShardplanError(f"the given mesh has ep={rt.ep}, the plan ep={plan_mesh.ep}")
    rt.tsp = tsp
    return rt
