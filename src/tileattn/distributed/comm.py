"""Point-to-point exchanges between the ranks of a ring (torch.distributed, gloo or NCCL).

At step s of a ring every rank r needs the keys/values of ``src = (r - s) mod W``. Rather than
relaying shards from neighbour to neighbour, rank r sends its OWN shard to ``(r + s) mod W`` and
receives straight from ``src``: the same bytes per rank as a relay, no chain of dependencies, and
a pair of ranks that has nothing to compute together (a causal contiguous shard after the
queries, keys outside a window) exchanges nothing. In the backward each rank returns the
gradient of a borrowed shard straight to its owner the same way.

A transfer is posted before the computation it overlaps and waited for after it. On NCCL the
sends and receives run on NCCL's own stream, which waits only for the work queued before the
post; ``wait`` makes the computing stream wait for the received bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Peers", "Transfer"]


class Transfer:
    """Sends and receives in flight; ``wait`` returns the received tensor (or None)."""

    def __init__(self, keep, received, works):
        self._keep, self._received, self._works = keep, received, works

    def wait(self):
        for work in self._works:
            work.wait()
        self._keep = None  # the send buffer may be freed now
        return self._received


class Peers:
    """Rank, world size and point-to-point exchanges within ``group`` (default: the world)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _global(self, r: int) -> int:
        r %= self.world_size
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def post(self, sends, recvs) -> Transfer:
        """Post sends and receives together: ``sends`` and ``recvs`` are lists of (group rank, tensor,
        tag), each tensor contiguous (a receive writes into its tensor)."""
        ops = [dist.P2POp(dist.isend, t, self._global(p), self.group, tag) for p, t, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group, tag) for p, t, tag in recvs]
        return Transfer(sends, None, dist.batch_isend_irecv(ops) if ops else [])

    def exchange(self, send, send_to, recv_like, recv_from, tag: int) -> Transfer:
        """Post a send of ``send`` (contiguous) to group rank ``send_to`` and a receive of a tensor of
        ``recv_like``'s shape and dtype from ``recv_from`` (either may be None: nothing to send / to
        receive)."""
        received = None
        if recv_like is not None:
            received = torch.empty(recv_like.shape, dtype=recv_like.dtype, device=recv_like.device)
        posted = self.post([] if send is None else [(send_to, send, tag)],
                           [] if received is None else [(recv_from, received, tag)])
        return Transfer(send, received, posted._works)
