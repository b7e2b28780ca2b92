"""The CPU tiles' forward for one call signature, decided once: ``prepare_fwd``.

The ops layer's memo (``tileattn.ops._memo``) keeps, per call signature, a launch that later
calls use instead of ``ops._custom.attention`` (the custom op's dispatch, ``_run_fwd``, the
backend lookup: about a third of a tiny decoding call on the CPU). Here that launch is
``attn_fwd`` itself with the options of the signature bound: every value-dependent choice
(the sequences' lengths, the tiles) is still made per call by ``attn_fwd``, which reads the
values on the host anyway. Calls with dropout (a seed per call) get none.
"""

from __future__ import annotations

from .attention import attn_fwd

__all__ = ["prepare_fwd", "PreparedFwd"]


def prepare_fwd(q, k, v, out, lse, *, params, alibi_slopes, max_seqlen_q: int, max_seqlen_k: int, seqused_k,
                block_table, num_splits: int, learnable_sink, k_descale) -> "PreparedFwd | None":
    """``attn_fwd`` with this signature's options bound (``out``/``lse`` stand for every call's
    outputs: their shapes and dtypes), or None for dropout."""
    if params.dropout_p > 0:
        return None
    return PreparedFwd(dict(params=params, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                            num_splits=num_splits), (tuple(out.shape), tuple(lse.shape), lse.dtype))


class PreparedFwd:
    """``prepared(q, k, v, alibi_slopes, learnable_sink, seqused_k, block_table, k_descale,
    v_descale)`` allocates (out, lse) as ``prepare_fwd``'s were, runs ``attn_fwd`` into them and
    returns them. ``calls`` counts its calls."""

    __slots__ = ("options", "out_shape", "lse_shape", "lse_dtype", "calls")

    def __init__(self, options: dict, outputs: tuple):
        self.options, self.calls = options, 0
        self.out_shape, self.lse_shape, self.lse_dtype = outputs

    def __call__(self, q, k, v, alibi_slopes, learnable_sink, seqused_k, block_table, k_descale, v_descale):
        out, lse = q.new_empty(self.out_shape), q.new_empty(self.lse_shape, dtype=self.lse_dtype)
        self.calls += 1
        attn_fwd(q, k, v, out, lse, alibi_slopes=alibi_slopes, seqused_k=seqused_k, block_table=block_table,
                 learnable_sink=learnable_sink, k_descale=k_descale, v_descale=v_descale, **self.options)
        return out, lse
