"""The CPU tiles' forward for one call signature, decided once: ``prepare_fwd``.

The ops layer's memo (``tileattn.ops._memo``) keeps, per call signature, a launch that later
calls use instead of ``ops._custom.attention`` (the custom op's dispatch, ``_run_fwd``, the
backend lookup: about a third of a tiny decoding call on the CPU). Here that launch is
``attn_fwd`` itself with the options of the signature bound: every value-dependent choice
(the sequences' lengths, the tiles) is still made per call by ``attn_fwd``, which reads the
values on the host anyway. A signature without ALiBi, splits, block table or descales first
tries ``attn_fwd``'s one-tile step (``fwd_one_tile``: decoding, short prefills), which skips
``attn_fwd``'s dispatch and allocates its outputs itself (the matmul's result is the output).
A decoding signature of batch 1 (one query row, fp32/fp64, no sinks; ``RowStep.bind`` says which)
goes before that to the one-row step with its views' sizes, strides and scale worked out here,
once: the signature fixes them (the memo keys shapes, strides and dtypes), as the Triton lane's
bound launch arguments do. Calls with dropout (a seed per call) get none.
"""

from __future__ import annotations

import torch

from .attention import RowStep, attn_fwd, autocast_on, fwd_one_tile

__all__ = ["prepare_fwd", "PreparedFwd"]


def prepare_fwd(q, k, v, out, lse, *, params, alibi_slopes, max_seqlen_q: int, max_seqlen_k: int, seqused_k,
                block_table, num_splits: int, learnable_sink, k_descale) -> "PreparedFwd | None":
    """``attn_fwd`` with this signature's options bound (``out``/``lse`` stand for every call's
    outputs: their shapes and dtypes), or None for dropout."""
    if params.dropout_p > 0:
        return None
    one_tile = alibi_slopes is None and num_splits <= 1 and block_table is None and k_descale is None
    row = RowStep.bind(q, k, v, params) if one_tile and learnable_sink is None else None
    return PreparedFwd(dict(params=params, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                            num_splits=num_splits), one_tile, row, (tuple(out.shape), tuple(lse.shape), lse.dtype))


class PreparedFwd:
    """``prepared(q, k, v, alibi_slopes, learnable_sink, seqused_k, block_table, k_descale,
    v_descale)`` returns (out, lse): from the bound one-row step (``row``) or ``fwd_one_tile`` when
    the signature fits it (``one_tile``) and the call is one tile, else allocated as
    ``prepare_fwd``'s were and written by ``attn_fwd``. ``calls`` counts its calls."""

    __slots__ = ("options", "one_tile", "row", "out_shape", "lse_shape", "lse_dtype", "calls")

    def __init__(self, options: dict, one_tile: bool, row: RowStep | None, outputs: tuple):
        self.options, self.one_tile, self.row, self.calls = options, one_tile, row, 0
        self.out_shape, self.lse_shape, self.lse_dtype = outputs

    def __call__(self, q, k, v, alibi_slopes, learnable_sink, seqused_k, block_table, k_descale, v_descale):
        if autocast_on():  # the steps' matmuls in the inputs' dtypes (``attention.without_autocast``)
            with torch.autocast("cpu", enabled=False):
                return self(q, k, v, alibi_slopes, learnable_sink, seqused_k, block_table, k_descale, v_descale)
        self.calls += 1
        if self.row is not None:
            res = self.row(q, k, v, seqused_k)
            if res is not None:
                return res
        if self.one_tile:
            res = fwd_one_tile(q, k, v, self.options["params"], seqused_k, learnable_sink)
            if res is not None:
                return res
        out, lse = q.new_empty(self.out_shape), q.new_empty(self.lse_shape, dtype=self.lse_dtype)
        attn_fwd(q, k, v, out, lse, alibi_slopes=alibi_slopes, seqused_k=seqused_k, block_table=block_table,
                 learnable_sink=learnable_sink, k_descale=k_descale, v_descale=v_descale, **self.options)
        return out, lse
