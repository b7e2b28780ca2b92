"""The backend contract: what ``attn_fwd`` / ``attn_bwd`` take, and ``AttnParams``.

A leaf module (it imports nothing from tileattn), so ``tileattn.ops``, ``tileattn.cpu``, ``tileattn.gpu``
and ``tileattn.distributed`` all depend on it and never on each other to name a type.
Two backends implement the same functions with the same arguments:

* ``tileattn.gpu``  — launchers of the Triton kernels in ``tileattn.kernels`` (CUDA tensors,
  or CPU tensors under ``TRITON_INTERPRET=1``);
* ``tileattn.cpu``  — the same recurrence over tiles written with torch ops (CPU tensors).

Which one runs is ``tileattn.ops.backend``'s choice.

The contract (inputs are already validated by ``tileattn.ops``; a backend never allocates
its outputs, it writes into the ones it is given, so tests can poison them with NaN)::

    attn_fwd(q, k, v, out, lse, *, params, alibi_slopes=None,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
             seqused_k=None, block_table=None, num_splits=1, learnable_sink=None,
             k_descale=None, v_descale=None) -> None

    attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, *, params, alibi_slopes=None,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
             deterministic=False, dlse=None, learnable_sink=None, dsink=None) -> None

    merge_parts(o_parts, lse_parts, out, lse) -> None

``merge_parts`` merges S partial states over disjoint key sets (``tileattn.ops.merge``'s rule),
o_parts (S, B, Sq, H, Dv) and lse_parts (S, B, H, Sq) contiguous fp32, into out (B, Sq, H, Dv;
any strides, any dtype) and lse (B, H, Sq) fp32 (a cascade's prefix and suffix states).

Layouts (last dim contiguous; other strides arbitrary, so views work):

* dense:   q (B, Sq, H, D); k, v (B, Sk, Hk, D); out (B, Sq, H, D); lse (B, H, Sq) fp32. v (and
  out, dout, dv) may have a head dim of its own, Dv (MLA); D means q/k's below.
* varlen:  ``cu_seqlens_q`` given: q (Tq, H, D), out (Tq, H, D), lse (H, Tq); sequence b owns
  rows cu_seqlens_q[b]:cu_seqlens_q[b+1]. Keys packed too, k, v (Tk, Hk, D) with
  ``cu_seqlens_k``, unless paged.
* paged:   ``block_table`` (B, max_blocks) int32 given: k, v are block pools
  (num_blocks, block_size, Hk, D); key p of sequence b is at
  ``pool[block_table[b, p // block_size], p % block_size]``. ``seqused_k`` is then required.
* ``seqused_k`` (B,) int32, when given, is the number of keys of sequence b (a KV cache
  filled up to there); otherwise Sk (dense) or cu_seqlens_k[b+1] - cu_seqlens_k[b].
* FP8 cache: k, v in float8_e4m3fn (q fp16 or bf16) with ``k_descale``/``v_descale`` contiguous
  (B, Hk) fp32; the keys are ``k.float() * k_descale[b, h]``, the values likewise.
* ``out`` may have any strides (last dim contiguous) and, for partial states merged later,
  dtype fp32 whatever q's.
* ``alibi_slopes``: None or (B, H) fp32 (the ops layer expands (H,) with a zero stride).
* H % Hk == 0: query head h reads key/value head h // (H // Hk). D <= 576 and Dv <= 512 for the
  forward; the backward takes D, Dv <= 256 on the Triton path (ops._validate refuses a call that
  may need gradients there), all of them on the CPU.
* Masks: query i of a sequence with seqlen_q, seqlen_k sees key j iff
  j <= i + (seqlen_k - seqlen_q) + window_right (if window_right >= 0) and
  j >= i + (seqlen_k - seqlen_q) - window_left (if window_left >= 0). causal == window_right 0.
  A row that sees no key: out 0, lse -inf; its gradients are 0.
* ``num_splits`` >= 1 splits the keys of every (sequence, head) into that many ranges whose
  partial (o, lse) states are merged (flash-decoding); any value gives the same answer.
  0 lets the backend choose (the Triton launcher splits when batch x heads cannot fill the
  GPU; the CPU path does not split).
* Dropout (params.dropout_p > 0): element (b, h, i, j) is kept iff
  ``tileattn.dropout_mask.keep_mask(params.dropout_seed, b * H + h, i, j, p)``; kept
  probabilities are scaled by 1 / (1 - p); the LSE is unaffected. A call on a part of a
  larger batch hashes the element's coordinates in that batch instead
  (``params.dropout_base``, ``params.dropout_nheads``; ``AttnParams.dropout_offsets``).
* ``learnable_sink``: None or (H,) fp32, one logit per query head that joins each row's softmax
  denominator without a value: lse = log(sum_j exp(s_ij) + exp(sink_h)), included in the
  returned lse; once per row, whatever num_splits. ``dsink`` (H,) receives its gradient.
* ``dlse``: None or shaped like lse, the gradient reaching the returned lse; the backward computes
  the gradients of sum(out * dout) + sum(lse * dlse) (delta = rowsum(dout * out) - dlse).
* The backward recomputes scores from q, k and the saved lse (no N x N buffer). dk, dv for a
  shared key/value head are summed over its query-head group. ``deterministic`` asks for
  bitwise-identical gradients run after run.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttnParams"]


@dataclass(frozen=True)
class AttnParams:
    """The scalar options of one attention call, normalised by ``tileattn.ops``.

    ``window_left``/``window_right`` < 0 mean unbounded; ``causal`` has been folded into
    ``window_right = 0``. ``softcap`` 0 means off; ``dropout_p`` 0 means off.

    ``diag_shift`` moves the diagonal: query i is aligned with key i + seqlen_k - seqlen_q +
    diag_shift, for the window bounds and ALiBi's distance alike. Public calls leave it 0; ring
    attention sets it so that a block of a longer sequence keeps the positions it has there.
    ``dropout_base`` does the same for the dropout mask, which hashes (batch, head, query, key):
    a ring block's call hashes the coordinates its elements have in the whole batch, element
    (b, h, i, j) of the call being element (b + b0, h + h0, i + i0, j + j0) of a batch of
    ``dropout_nheads`` query heads (0: the call's own), e.g. a chunk of heads of a document of
    a packed batch (``dropout_offsets`` folds this into the counters the backends hash).
    """

    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    dropout_p: float = 0.0
    dropout_seed: int = 0
    diag_shift: int = 0
    dropout_base: tuple[int, int, int, int] = (0, 0, 0, 0)  # (batch, head, query, key) added to dropout's coordinates
    dropout_nheads: int = 0  # query heads of the batch dropout_base places the call in; 0: the call's own

    def dropout_offsets(self, nheads: int) -> tuple[int, int, int, int]:
        """``(bh0, bh_stride, i0, j0)`` for a call of ``nheads`` query heads: its element (b, h, i, j)
        hashes as ``keep_mask(dropout_seed, b * bh_stride + bh0 + h, i + i0, j + j0, p)``."""
        b0, h0, i0, j0 = self.dropout_base
        stride = self.dropout_nheads or nheads
        return b0 * stride + h0, stride, i0, j0
