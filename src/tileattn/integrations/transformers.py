"""``attn_implementation="tileattn"`` for Hugging Face transformers models.

    import tileattn.integrations.transformers          # registers "tileattn" (or call register())
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tileattn")
    model.set_attn_implementation("tileattn")         # or switch an existing model

Every model whose attention layers call transformers' attention-function registry (Llama,
Mistral, Qwen2, Gemma 2 and most recent decoders) then computes

    out = softmax(scaling * q k^T [softcapped] + causal/sliding-window/padding masks) v

with tileattn, in training (dropout included) and in ``generate()`` with transformers' own
KV caches. What the layer hands over, and what tileattn does with it:

* query (batch, nheads, seqlen_q, headdim), key/value (batch, nheads_k, seqlen_k, headdim),
  the K/V heads not repeated: tileattn reads grouped heads by index (GQA, MQA).
* ``is_causal`` (or ``module.is_causal``): causal aligned bottom-right, so the seqlen_q new
  tokens are the tail of seqlen_k cached + new keys.
* ``sliding_window`` w: query at position p sees keys p - w + 1 ... p, i.e.
  ``window_size=(w - 1, w - 1)`` (the right bound is cut to 0 by causal), as flash-attn.
* ``attention_mask``: tileattn registers a mask function too, so the model hands over the
  2-D padding mask (batch, seqlen_k) — or None when nothing is padded; with a static cache,
  the mask at the cache's fixed width, its unfilled slots marked. A decoding step of a
  left-padded batch (every query real, each row's real keys one run ending at its last query:
  what ``generate()`` produces) attends through a ``DecodePlan`` with ``cache_leftpad``, made by
  the step's first layer and run by the others: each row's keys are read in place, nothing
  gathered. The step's plan is the last step's carried on (``DecodePlan.next_step``: only what
  the longer caches and the new lengths change is worked out again). Other padded batches are
  unpacked with the mask (``flash_attn_varlen_func`` over the real tokens only) and re-padded;
  padded query rows come back as zeros. Without causality or a window (an encoder's
  self-attention, an encoder-decoder's cross-attention) the mask marks keys only: every query
  attends to its row's real keys, however many queries there are. (Any extra pattern
  transformers would overlay on a 4-D mask — image-token blocks, chunked attention — is not
  represented: flash-attn does the same.) A 4-D mask passed by the user is refused with an error.
* ``s_aux`` (gpt-oss): a learned sink logit per query head, passed as tileattn's
  ``learnable_sink`` (in float32, or float64 for a float64 model; its gradient flows back to
  the parameter).
* packed batches without padding (rows holding several sequences each): the
  ``cu_seq_lens_q/k`` + ``max_length_q/k`` keywords (e.g. from
  ``DataCollatorWithFlattening``) or, in eager mode, restarts in ``position_ids``.

Host synchronisation: in eager mode a mask is read on the host once per mask tensor, one copy
of three counts per row (first real slot, real slots, filled slots), in the mask function (which
returns None when every key is real); every layer that gets the mask reuses it. A left-padded
decoding step needs no other read (its plan's lengths come from the counts on the device, and
are checked on the host against the counts read there: no check is launched). Any
other mask is then removed exactly by reading it once more to pack the real tokens, as
flash-attn's transformers path does, also once per mask tensor. Under ``torch.compile`` nothing is read on the
host, so ``fullgraph=True`` traces the model: the mask function keeps the mask, and each
padded row becomes three segments of one varlen batch (real tokens must form one run per
row: left or right padding); restarts in ``position_ids`` are not looked for (pass
``cu_seq_lens_*`` for packed rows).

Needs transformers 5.4 or later: ``AttentionInterface``, and ``masking_utils.AttentionMaskInterface``
calling a mask function with ``q_length`` / ``q_offset`` (4.53 to 5.3 pass ``cache_position``
instead; ``register`` refuses them).
"""

from __future__ import annotations

import re
import threading

import torch
import torch.nn.functional as F

from ..ops._custom import _needs_graph
from ..ops._validate import vouch, vouch_lengths
from ..ops.attention import flash_attn_func
from ..ops.decode_plan import DecodePlan
from ..ops.varlen import flash_attn_varlen_func

__all__ = ["NAME", "register", "tileattn_attention_forward", "tileattn_mask"]

NAME = "tileattn"
_NOT_FILLED = -1  # a static cache's key slot past the tokens seen so far (tileattn_mask's int8 form)
# transformers' bidirectional mask function (an encoder's or a cross-attention's mask), looked up by
# register(): an import inside tileattn_mask breaks torch.compile's graph (dynamo refuses transformers'
# lazy module as an import result)
_BIDIRECTIONAL = None


MIN_TRANSFORMERS = (5, 4)  # the mask function's q_length / q_offset arguments (5.0-5.3: cache_position)


def register() -> None:
    """Register ``"tileattn"`` with transformers' attention and mask registries (idempotent)."""
    need = ".".join(map(str, MIN_TRANSFORMERS))
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        raise ImportError(f"tileattn's transformers integration needs transformers {need} or later: "
                          f"pip install 'transformers>={need}'") from err
    have = tuple(int(p) for p in re.findall(r"\d+", transformers.__version__)[:2])
    if have < MIN_TRANSFORMERS:
        raise ImportError(f"tileattn's transformers integration needs transformers {need} or later (its mask "
                          f"functions take q_length / q_offset), found {transformers.__version__}: "
                          f"pip install 'transformers>={need}'")
    global _BIDIRECTIONAL
    from transformers import masking_utils

    _BIDIRECTIONAL = getattr(masking_utils, "bidirectional_mask_function", None)
    AttentionInterface.register(NAME, tileattn_attention_forward)
    AttentionMaskInterface.register(NAME, tileattn_mask)


def tileattn_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask transformers hands to every "tileattn" layer: the padding mask, or None.

    ``attention_mask`` (batch, seen + q_length) marks real tokens. Its last ``kv_length``
    columns are the keys of this forward (a sliding-window cache keeps only the newest ones):
    returned as bool, or None when every key is real (checked in eager mode only, by the one host
    read the layers then reuse, ``_mask_runs``: under torch.compile the mask is kept, since
    reading it would break the graph).

    A static cache has more key slots (``kv_length``) than tokens seen so far, and transformers
    tells its query offset as a tensor. Its mask is returned at the cache's fixed width as
    int8: 1 real, 0 padding, -1 a slot not filled yet (from ``q_offset``; transformers turns
    the mask to bool before each layer asks again, so the marks are made here each time).
    generate() builds this mask outside the compiled decoding step, so the step sees the same
    shape every time (a growing mask would recompile it and record a new CUDA graph per token).
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].to(torch.bool)
    width = attention_mask.shape[1]
    if _bidirectional(mask_function):  # an encoder's or a cross-attention's keys: no cache fills them
        return None if _every_key_real(attention_mask, kv_length) else attention_mask
    filled = q_offset - kv_offset + q_length  # key slots in use: kv_length unless the cache is static
    if not isinstance(filled, torch.Tensor):
        filled = min(filled, width)  # a mask shorter than the keys: the slots past it are not filled
    if isinstance(filled, torch.Tensor) or filled < kv_length:
        mask = F.pad(attention_mask, (0, kv_length - width), value=False).to(torch.int8)
        slots = torch.arange(kv_length, device=mask.device)
        in_use = slots < torch.as_tensor(filled, device=mask.device)
        return torch.where(in_use, mask, torch.full_like(mask, _NOT_FILLED))
    return None if _every_key_real(attention_mask, kv_length) else attention_mask


def _every_key_real(attention_mask: torch.Tensor, kv_length: int) -> bool:
    """Whether a bool mask covers kv_length keys, all real (eager mode only: read once per mask
    tensor, the layers that get it reuse what was read; under torch.compile the mask is kept)."""
    return (attention_mask.shape[1] == kv_length and not torch.compiler.is_compiling()
            and _mask_runs(attention_mask).every_key_real())


def _bidirectional(mask_function) -> bool:
    """Whether transformers asks for a bidirectional mask (an encoder's self-attention or a
    decoder's cross-attention): its keys are not the tokens seen so far followed by the queries,
    so the mask alone tells which are real (the decoder may have fewer or more queries)."""
    return _BIDIRECTIONAL is not None and mask_function is _BIDIRECTIONAL


def tileattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, sliding_window: int | None = None,
                               softcap: float | None = None, is_causal: bool | None = None,
                               s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns (out (batch, seqlen_q, nheads, headdim), None).

    query (batch, nheads, seqlen_q, headdim), key/value (batch, nheads_k, seqlen_k, headdim).
    ``kwargs`` carries what the model passes along (position_ids, cache details, ...); the
    ones tileattn reads are ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids`` and
    ``output_attentions`` (refused: the probabilities are never formed).
    """
    if kwargs.get("output_attentions"):
        raise ValueError("tileattn never forms the attention probabilities: use attn_implementation='eager' "
                         "for output_attentions=True")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    options = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=causal, window_size=window,
                   softcap=float(softcap or 0.0))
    if s_aux is not None:  # sinks (gpt-oss): one logit per query head, fp32 for tileattn
        options["learnable_sink"] = s_aux.to(torch.float64 if query.dtype == torch.float64 else torch.float32)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, headdim) views
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]

    if attention_mask is not None:
        return _padded_attention(q, k, v, attention_mask, options), None
    packed = _packed_offsets(kwargs, batch, seqlen_q, seqlen_k, q.device)
    if packed is not None:
        cu_q, cu_k, max_q, max_k = packed
        out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu_q, cu_k, max_q, max_k, **options)
        return out.view(q.shape), None
    return flash_attn_func(q, k, v, **options), None


def _padded_attention(q, k, v, attention_mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention of a padded batch: key j of row b is real iff mask[b, j] is true (bool) or 1 (int8).

    A bool mask covers the first ``width`` key positions, and the queries are its last
    seqlen_q (a static cache holds seqlen_k >= width slots; the ones past the mask are not
    filled yet). tileattn_mask's int8 form spans all seqlen_k slots and marks the unfilled
    ones -1: there ``width`` is the count of the others, read on the device.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"tileattn takes the 2-D padding mask (batch, seqlen_k), got shape "
                         f"{tuple(attention_mask.shape)}: custom 4-D masks need attn_implementation='sdpa' or 'eager'")
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    width = attention_mask.shape[1]
    # Without causality or a window a query's keys do not depend on where it sits: every query is
    # kept and attends to its row's real keys. That is also the only reading of a cross-attention
    # mask (an encoder-decoder's decoder queries over the encoder's padded keys), whose queries
    # are no columns of it.
    keys_only = not options["causal"] and tuple(options["window_size"]) == (-1, -1)
    if attention_mask.shape[0] != batch or width > seqlen_k or (width < seqlen_q and not keys_only):
        lower = "" if keys_only else f"{seqlen_q} <= "
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({batch}, n) with "
                         f"{lower}n <= {seqlen_k}")
    if torch.compiler.is_compiling():
        keys_real, first_query = _real_keys(attention_mask, q.device, seqlen_q, seqlen_k)
        return _segmented_attention(q, k, v, keys_real, None if keys_only else first_query, options)
    if options["dropout_p"] == 0 and not _needs_graph(q, k, v, options.get("learnable_sink")):
        plan = _mask_runs(attention_mask).decode_plan(q, k, v, options)
        if plan is not None:  # every query real, each row's keys one run ending at its last query
            # decode_plan compared q, k, v with the plan (or made it from them)
            return plan._run_fitted(q, k, v, learnable_sink=options.get("learnable_sink"))
    packing = _packing(attention_mask, q.device, seqlen_q, seqlen_k, keys_only)
    return _unpadded_attention(q, k, v, packing, options)


def _real_keys(attention_mask, device, seqlen_q: int, seqlen_k: int):
    """(keys_real (batch, seqlen_k) bool, first_query): which key slots hold tokens, and the key
    position of the first query (an int, or for the int8 form a (batch,) tensor, equal across rows)."""
    mask = attention_mask.to(device=device)
    if mask.dtype == torch.int8:  # the static-cache form: (batch, seqlen_k), -1 past the tokens seen
        return mask == 1, (mask != _NOT_FILLED).sum(1) - seqlen_q
    return F.pad(mask.to(torch.bool), (0, seqlen_k - mask.shape[1]), value=False), mask.shape[1] - seqlen_q


# What was last worked out of a mask or of position_ids: every layer of a step gets the same
# tensor, so its host reads and index computations run once per step, not once per layer.
_LAST: dict = {}


def _reused(kind: str, source: torch.Tensor, key: tuple, compute):
    """``compute()``, or its result from the last call of this ``kind`` if that was for the same
    tensor, unmodified since (its version counter; an inference tensor has none: recomputed),
    with the same ``key``."""
    version = None if source.is_inference() else source._version
    last = _LAST.get(kind)
    if version is not None and last is not None and last[0] is source and last[1] == (version, key):
        return last[2]
    result = compute()
    _LAST[kind] = (source, (version, key), result)
    return result


# The latest decoding plan of each set of options (``_Runs.decode_plan``'s key), with the thread
# (on a GPU the stream, and whether under inference mode) that made it: the next step's plan, for the next mask, continues it
# (``DecodePlan.next_step``: only what the step's longer caches and new lengths change is worked out
# again) on that thread and stream only (a continued plan shares the split workspace: another
# thread's or stream's generate() may be in flight).
_STEP_PLANS: dict = {}


def _step_owner(device) -> tuple:
    """(thread, current stream on a GPU else 0, inference mode): who may carry a step's plan on
    (``_STEP_PLANS``). A plan made under ``torch.inference_mode`` holds inference tensors (its
    workspace) that a step outside it may not write."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    return threading.get_ident(), stream, torch.is_inference_mode_enabled()


class _Runs:
    """Where each row's real keys lie in a padding mask (bool, or tileattn_mask's int8 form), read
    on the host in one copy: per row the first real slot, the count of real slots and the count
    of filled ones (the mask's width, or the int8 form's slots not marked -1). Kept per mask
    tensor (``_mask_runs``) with the decoding plans made from it."""

    def __init__(self, attention_mask: torch.Tensor):
        mask = attention_mask
        real = mask == 1 if mask.dtype == torch.int8 else mask.to(torch.bool)
        count = real.sum(1)
        first = real.view(torch.uint8).argmax(1)  # the first real slot (0 for a row without one)
        filled = (mask != _NOT_FILLED).sum(1) if mask.dtype == torch.int8 else torch.full_like(count, mask.shape[1])
        self.tensor = torch.stack([filled, first, count])  # (3, batch) on the mask's device
        self.filled, self.first, self.count = self.tensor.tolist()
        self.width, self.plans = mask.shape[1], {}
        # the fewest real keys of a row when every row's are one run ending at its last filled slot, else -1
        one_run = self.count and all(n == f - s for f, s, n in zip(self.filled, self.first, self.count))
        self.shortest_run = min(self.count) if one_run else -1

    def every_key_real(self) -> bool:
        return all(n == self.width for n in self.count)

    def decode_plan(self, q, k, v, options: dict) -> DecodePlan | None:
        """A ``DecodePlan`` of these layers' attention when every row's real keys are one run that
        ends at its last filled slot and holds its seqlen_q queries (left padding at a decoding
        step): cache_seqlens the filled slots, cache_leftpad the first real one, read in place.
        None otherwise. Made once per mask, q/k/v layout and options: every layer of the step
        that has them runs the same plan."""
        if self.shortest_run < q.shape[1]:
            return None
        sink = options.get("learnable_sink")
        # the sinks' layout, not only whether there are any: a plan's sinks stand for every layer's
        key = (options["softmax_scale"], options["causal"], options["window_size"], options["softcap"],
               None if sink is None else (sink.shape, sink.dtype, sink.device))
        plan = self.plans.get(key)
        if plan is None or not plan.fits(q, k, v):
            lengths = self.tensor.to(device=q.device, dtype=torch.int32)  # (filled, first, count)
            seqlens, leftpad = lengths[0], lengths[1]
            # read on the host (filled, first): the plan checks them there, launching no check
            vouch_lengths(seqlens, leftpad, self.filled)
            owner = _step_owner(q.device)
            last = _STEP_PLANS.get(key)
            last = last[1] if last is not None and last[0] == owner else None
            if last is None:
                plan = DecodePlan(q, k, v, seqlens, cache_leftpad=leftpad, softmax_scale=options["softmax_scale"],
                                  causal=options["causal"], window_size=options["window_size"],
                                  softcap=options["softcap"], learnable_sink=sink)
            else:  # the same options: what the DecodePlan above would be (a new one unless only the caches grew)
                plan = last.next_step(q, k, v, seqlens, cache_leftpad=leftpad)
            self.plans[key] = plan
            _STEP_PLANS[key] = (owner, plan)
        return plan


def _mask_runs(attention_mask: torch.Tensor) -> _Runs:
    """``_Runs`` of a mask, once per mask tensor (tileattn_mask's call and the layers' share it)."""
    return _reused("runs", attention_mask, (), lambda: _Runs(attention_mask))


def _packing(attention_mask, device, seqlen_q: int, seqlen_k: int, keys_only: bool = False) -> tuple:
    """What ``_unpadded_attention`` needs of a mask (reads it on the host), once per mask tensor.
    ``keys_only``: the mask marks keys only, every query is real (non-causal without a window)."""
    return _reused("mask", attention_mask, (seqlen_q, seqlen_k, device, keys_only),
                   lambda: _pack(attention_mask, device, seqlen_q, seqlen_k, keys_only))


def _pack(attention_mask, device, seqlen_q: int, seqlen_k: int, keys_only: bool = False) -> tuple:
    keys_real, first_query = _real_keys(attention_mask, device, seqlen_q, seqlen_k)
    if keys_only:
        queries_real = keys_real.new_ones(keys_real.shape[0], seqlen_q)
    else:
        if isinstance(first_query, torch.Tensor):
            first_query = int(first_query[0])
        queries_real = keys_real[:, first_query:first_query + seqlen_q]
    qb, qs = queries_real.nonzero(as_tuple=True)  # real query (row, position), row-major like cu_seqlens
    kb, ks = keys_real.nonzero(as_tuple=True)
    lengths = torch.stack([queries_real.sum(1), keys_real.sum(1)]).to(torch.int32)  # (2, batch)
    cu = F.pad(lengths.cumsum(1, dtype=torch.int32), (1, 0))  # (2, batch + 1)
    max_q, max_k = lengths.max(1).values.tolist()
    # offsets built here from non-negative counts: the varlen call need not check them on the device
    cu_q = vouch(cu[0], ("cu_seqlens", qb.numel(), max_q))
    cu_k = vouch(cu[1], ("cu_seqlens", kb.numel(), max_k))
    return qb, qs, kb, ks, cu_q, cu_k, max_q, max_k


def _unpadded_attention(q, k, v, packing: tuple, options: dict) -> torch.Tensor:
    """Gather the real tokens into a packed batch, attend (varlen), scatter back; padded query rows get 0.

    Any mask works. Query i of a row is real iff its key position first_query + i is; with the
    masks aligned bottom-right per row, real query i sees the real keys up to its position.
    """
    qb, qs, kb, ks, cu_q, cu_k, max_q, max_k = packing
    if qb.shape[0] == q.shape[0] * q.shape[1]:  # every query is real (a decoding step): no gather, no scatter
        out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k[kb, ks], v[kb, ks], cu_q, cu_k, max_q, max_k,
                                     **options)
        return out.view(q.shape)
    out = flash_attn_varlen_func(q[qb, qs], k[kb, ks], v[kb, ks], cu_q, cu_k, max_q, max_k, **options)
    return out.new_zeros(q.shape).index_put((qb, qs), out)


def _segmented_attention(q, k, v, keys_real, first_query: int | torch.Tensor | None, options: dict) -> torch.Tensor:
    """The same without reading the mask on the host (static shapes, for torch.compile).

    Assumes the real tokens of each row form one run [start, end) of key positions — left
    or right padding, as tokenizers and generate() produce; a mask with holes fails a
    device-side assertion (eager mode handles any mask). Every row becomes three sequences of one varlen batch over all batch x seqlen rows:
    the padding before the run, the run, the padding after it. Padded query rows attend among
    padding: finite values nobody reads. ``first_query`` None: every query is real and attends to
    the run (non-causal without a window, e.g. cross-attention), the padding segments get no query.
    """
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    pos = torch.arange(seqlen_k, device=q.device)
    start = torch.where(keys_real, pos, seqlen_k).amin(1)  # (batch,), seqlen_k for a row without real keys
    end = torch.maximum(torch.where(keys_real, pos + 1, 0).amax(1), start)
    # A mask with holes would be cut wrongly: refuse it on the device (no host read under compile).
    torch._assert_async((keys_real.sum(1) == end - start).all(),
                        "tileattn under torch.compile needs the real tokens of each row in one run (left or right "
                        "padding); a padding mask with holes needs eager mode")
    bounds_k = torch.stack([torch.zeros_like(start), start, end], 1)  # (batch, 3) key positions
    if first_query is None:  # all queries in the run's segment
        bounds_q = torch.tensor([0, 0, seqlen_q], device=q.device).expand(batch, 3)
    else:
        first_query = torch.as_tensor(first_query, device=q.device).reshape(-1, 1)  # an int, or (batch,) on the device
        bounds_q = (bounds_k - first_query).clamp(0, seqlen_q)  # the same cuts among the queries
    rows = torch.arange(batch, device=q.device)[:, None]

    def offsets(bounds, seqlen):  # (3 * batch + 1,) int32
        flat = (bounds + rows * seqlen).flatten()
        return torch.cat([flat, flat.new_full((1,), batch * seqlen)]).to(torch.int32)

    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                 v.reshape(-1, *v.shape[2:]), offsets(bounds_q, seqlen_q), offsets(bounds_k, seqlen_k),
                                 seqlen_q, seqlen_k, **options)
    return out.view(q.shape)


def _packed_offsets(kwargs: dict, batch: int, seqlen_q: int, seqlen_k: int, device):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a packed row, or None.

    From the ``cu_seq_lens_*`` / ``max_length_*`` keywords when given (all four); otherwise, in
    eager mode for rows of fresh tokens, from ``position_ids``: a sequence starts at each row's
    first token and wherever the position does not continue the previous one by 1.
    """
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    given = [kwargs.get(n) for n in names]
    if all(x is not None for x in given):
        cu_q, cu_k, max_q, max_k = given
        return cu_q.to(device, torch.int32), cu_k.to(device, torch.int32), int(max_q), int(max_k)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or seqlen_q != seqlen_k or seqlen_q < 2 or torch.compiler.is_compiling():
        return None
    rows = position_ids.shape[0] if position_ids.dim() == 2 else 1 if position_ids.dim() == 1 else 0
    if rows not in (1, batch) or position_ids.shape[-1] != seqlen_q:  # e.g. multimodal (3, batch, seqlen) positions
        return None
    return _reused("positions", position_ids, (batch, seqlen_q, device),
                   lambda: _restarts(position_ids, batch, seqlen_q, device))


def _restarts(position_ids, batch: int, seqlen_q: int, device):
    """The packed sequences of the rows from where their positions restart (read on the host), as
    transformers' eager and SDPA masks find them: a sequence starts at each row's first token and
    wherever a position does not continue the previous one by 1. Positions of one row (1, seqlen)
    hold for every row. None when no row restarts."""
    pos = position_ids.reshape(-1, seqlen_q)
    starts = F.pad(pos[:, 1:] - pos[:, :-1] != 1, (1, 0), value=True)  # (rows, seqlen)
    if int(starts.sum()) == starts.shape[0]:
        return None
    starts = starts.expand(batch, seqlen_q).flatten()
    bounds = [*starts.nonzero().flatten().tolist(), batch * seqlen_q]
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    # built here from increasing bounds: the varlen call need not check them on the device
    cu = vouch(torch.tensor(bounds, dtype=torch.int32, device=device), ("cu_seqlens", batch * seqlen_q, longest))
    return cu, cu, longest, longest


register()
