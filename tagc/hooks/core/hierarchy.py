"""Where a group's ranks sit on hosts, and the two-step (hierarchical) reduce-scatter across hosts.

Ranks are numbered host-major, as torchrun numbers them: global rank ``r`` is on host ``r // G`` with
local index ``r % G`` (``G`` ranks per host). The hierarchical exchange (docs/design.md §11) reduces
plainly inside each host (:func:`host_reduce`, a fair reduce-scatter over the *local* group, giving a
host-reduced block ``[H, C]``), then exchanges that block compressed over the *cross* group (the ``H``
ranks with local index ``l``), with the codec planned for ``H`` ranks (:mod:`tagc.hooks.core.engine`).

:class:`Topology` describes one group; :func:`topology` builds it, creating the subgroups
(every rank of the group must call it, in the same order).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from tagc.config import is_int
from tagc.hooks.core.transport import plain_reduce_scatter

HIERARCHIES = ("auto", "flat")
"""``hierarchy=``: ``"auto"`` exchanges hierarchically when a group spans more than one host,
``"flat"`` always over the whole group (one all-to-all)."""


def check_hierarchy(hierarchy: str) -> str:
    """``hierarchy`` if it is one of :data:`HIERARCHIES`, else a clear error."""
    if hierarchy not in HIERARCHIES:
        raise ValueError(f"hierarchy must be one of {HIERARCHIES} ('auto': hierarchical when the group spans more "
                         f"than one host; 'flat': one exchange over the whole group), got {hierarchy!r}")
    return hierarchy


def resolve_ranks_per_host(ranks_per_host: Optional[int]) -> Optional[int]:
    """``ranks_per_host`` as given (an int >= 1), or torchrun's ``LOCAL_WORLD_SIZE`` when it is ``None``
    (``None`` again when that is not set: one host)."""
    if ranks_per_host is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if not env:
            return None
        if not env.strip().isdigit() or int(env) < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE={env!r} is not a positive integer: pass ranks_per_host= explicitly")
        return int(env)
    if not is_int(ranks_per_host) or ranks_per_host < 1:
        raise ValueError(
            f"ranks_per_host must be None (torchrun's LOCAL_WORLD_SIZE, else one host) or an integer >= 1, "
            f"got {ranks_per_host!r}"
        )
    return ranks_per_host


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """How one group's ranks sit on hosts; for a hierarchical exchange, its two subgroups.

    ``remote_rows`` counts the group's ranks on other hosts than this rank's: the rows of a flat
    all-to-all that leave the host (0 on one host, or when ``ranks_per_host`` is unknown)."""

    world: int
    hosts: int = 1
    remote_rows: int = 0
    local: Optional[dist.ProcessGroup] = None
    """Hierarchical: this rank's host's ranks of the group (``G`` of them, by local index)."""
    cross: Optional[dist.ProcessGroup] = None
    """Hierarchical: the group's ranks with this rank's local index (``H`` of them, by host)."""

    @property
    def hierarchical(self) -> bool:
        return self.cross is not None

    @property
    def per_host(self) -> int:
        """``G``: the group's ranks per host (hierarchical: every host holds as many)."""
        return self.world // self.hosts

    def step1_bytes(self, chunk: int, dtype: torch.dtype) -> int:
        """Bytes this rank sends in the intra-host step of a hierarchical exchange of ``chunk``-element
        chunks: ``G - 1`` blocks of ``H`` chunks (0 when flat)."""
        return (self.per_host - 1) * self.hosts * chunk * dtype.itemsize if self.hierarchical else 0


def group_ranks(group: Optional[dist.ProcessGroup]) -> tuple[int, ...]:
    """The global ranks of ``group``, by group rank (the default group: ``range(world)``)."""
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def layout(ranks: Sequence[int], me: int, ranks_per_host: Optional[int], world_size: int) -> tuple[int, int, bool]:
    """``(hosts, remote_rows, regular)`` of a group of global ``ranks`` seen from global rank ``me``.

    ``regular``: host-major with as many ranks on every host, so its rows view as ``[H, G, C]``."""
    if ranks_per_host is None:
        return 1, 0, False
    if world_size % ranks_per_host:
        raise ValueError(f"ranks_per_host={ranks_per_host} does not divide the world size {world_size} "
                         "(ranks are numbered host-major, as torchrun numbers them: pass the ranks per host)")
    hosts = [r // ranks_per_host for r in ranks]
    mine = me // ranks_per_host
    distinct = sorted(set(hosts))
    per = len(ranks) // len(distinct)
    regular = len(ranks) == per * len(distinct) and hosts == [h for h in distinct for _ in range(per)]
    return len(distinct), sum(h != mine for h in hosts), regular


def topology(group: Optional[dist.ProcessGroup], hierarchy: str, ranks_per_host: Optional[int]) -> Topology:
    """The topology of ``group``; a hierarchical one when ``hierarchy == "auto"`` and the group spans
    several hosts with as many (more than one) of its ranks on each.

    Creates the ``H`` local and ``G`` cross subgroups, all of them, in the same order on every rank:
    with ``dist.new_group`` when the group is the whole world (every process calls it), with
    ``use_local_synchronization=True`` otherwise (ranks outside the group never get here). Not a
    hot path: once per group (the hook caches it)."""
    ranks = group_ranks(group)
    me = dist.get_rank()
    hosts, remote, regular = layout(ranks, me, ranks_per_host, dist.get_world_size())
    world = len(ranks)
    if hierarchy != "auto" or hosts == 1 or not regular or world == hosts:
        return Topology(world, hosts, remote)
    per = world // hosts
    whole = world == dist.get_world_size()
    lists = [list(ranks[h * per : (h + 1) * per]) for h in range(hosts)] + [list(ranks[j::per]) for j in range(per)]
    made = [dist.new_group(members, use_local_synchronization=not whole) for members in lists]
    index = ranks.index(me)
    return Topology(world, hosts, remote, local=made[index // per], cross=made[hosts + index % per])


def host_reduce(rows: torch.Tensor, topo: Topology, piece_bytes: Optional[int] = None) -> tuple[torch.Tensor, int]:
    """Step 1, plain: ``rows`` (``[N, C]``, row ``j`` = group rank ``j``'s chunk) -> this rank's
    host-reduced block ``[H, C]`` (row ``h'`` = the chunk of rank ``(h', l)``, summed over this host's
    ranks in float32 (on NCCL by its own reduce-scatter: :func:`tagc.hooks.core.transport.reduce_scatter_rows`),
    returned in ``rows``' dtype) and the bytes this rank sent. Blocking."""
    hosts, per = topo.hosts, topo.per_host
    chunk = rows.shape[1]
    send = rows.view(hosts, per, chunk).transpose(0, 1).reshape(per, hosts * chunk)
    summed, sent = plain_reduce_scatter(send, topo.local, piece_bytes)
    return summed.view(hosts, chunk).to(rows.dtype), sent
