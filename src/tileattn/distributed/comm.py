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

import struct

import torch
import torch.distributed as dist

__all__ = ["Peers", "Transfer", "agree", "signature"]


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


# ----------------------------------------------------------------------------- one call on every rank

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def signature(**fields) -> dict[str, int]:
    """A call's shapes and options as int64 fields to compare across the ranks: ints as they are,
    floats by their bits, bools as 0/1, dtypes by index, tensors of int values by a digest."""
    out = {}
    for name, value in fields.items():
        if isinstance(value, torch.dtype):
            value = _DTYPES.index(value) if value in _DTYPES else -1
        elif isinstance(value, float):
            value = struct.unpack("<q", struct.pack("<d", value))[0]
        elif isinstance(value, (list, tuple)):  # offsets: a polynomial digest mod 2**61 - 1
            digest = len(value)
            for x in value:
                digest = (digest * 1000003 + int(x)) % (2**61 - 1)
            value = digest
        out[name] = int(value)
    return out


def _shown(name: str, value: int) -> str:
    if name in ("softmax_scale", "softcap", "dropout_p"):
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if name == "dtype":
        return str(_DTYPES[value]) if 0 <= value < len(_DTYPES) else "?"
    return str(value)


def agree(name: str, peers: Peers, fields: dict[str, int] | None, error: Exception | None, device,
          extra: list[int] | None = None, n_extra: int = 0) -> list[list[int]]:
    """Make every rank raise where any rank would: all-gather each rank's call ``fields`` (its
    shapes and options, which every rank must share), whether its own input checks failed
    (``error``), and ``n_extra`` integers of its own (``extra``); then raise on EVERY rank if any
    rank refused its inputs (that rank its own exception) or the ranks' fields differ, before the
    ring exchanges anything — a rank that raised alone would leave the others waiting in the
    ring. Returns every rank's ``extra``. A world of one rank raises ``error`` at once."""
    if peers.world_size == 1:
        if error is not None:
            raise error
        return [list(extra or [])]
    keys = [] if error is not None else list(fields)
    assert len(keys) <= _N_FIELDS
    row = [1, 0] if error is not None else [0, len(keys)] + [fields[k] for k in keys]
    width = 2 + _N_FIELDS + n_extra
    mine = torch.zeros(width, dtype=torch.int64, device=device)
    mine[:len(row)] = torch.tensor(row, dtype=torch.int64, device=device)
    if error is None and extra:
        mine[2 + _N_FIELDS:] = torch.tensor(extra, dtype=torch.int64, device=device)
    gathered = mine.new_empty(peers.world_size * width)
    _all_gather(gathered, mine, group=peers.group)
    rows = gathered.view(peers.world_size, width).tolist()
    if error is not None:
        raise error
    refused = [r for r, x in enumerate(rows) if x[0]]
    if refused:
        raise ValueError(f"{name}: rank(s) {refused} refused their inputs (their own exception says why); every "
                         "rank stops here rather than wait for them in the ring")
    for i, key in enumerate(keys):
        values = [x[2 + i] for x in rows]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {_shown(key, v)}" for r, v in enumerate(values))
            if key == "cu_seqlens":
                shown = "their values: the same on every rank, global or the global ones // world_size"
            raise ValueError(f"{name}: every rank must call with the same shapes and options, but {key} differs "
                             f"across the ranks ({shown})")
    return [x[2 + _N_FIELDS:] for x in rows]


_N_FIELDS = 24  # the most fields a signature has (the row's width is fixed across the ranks)
# newer torch names it all_gather_single and deprecates the old name (same arguments)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
