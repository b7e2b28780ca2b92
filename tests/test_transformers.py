"""tileattn inside Hugging Face transformers models: attn_implementation="tileattn".

Tiny random models built from configs (2 layers, hidden 64, 4 query heads over 2 KV heads,
vocab 128), Llama-, Mistral- (sliding window), Qwen2-style (full and sliding layers) and
gpt-oss-style (a sliding then a full layer, learned attention sinks passed as ``s_aux``).
Logits and gradients follow the tolerance rule of tests/tolerance.py: the float64 model with
eager attention is the oracle, eager attention in the same dtype sets the budget.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from tileattn import reference as R
from tolerance import GRAD_FACTOR, assert_within, plain_attention

transformers = pytest.importorskip("transformers")

import tileattn.integrations.transformers as tt  # noqa: E402  (registers "tileattn")
from tileattn.ops.decode_plan import DecodePlan  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, pad_token_id=0)


def make_config(kind: str, **overrides):
    """A tiny config; 'mistral' slides a window of 6 over every layer, 'qwen2' over layer 1 only."""
    if kind == "llama":
        return transformers.LlamaConfig(**SIZES, **overrides)
    if kind == "mistral":
        return transformers.MistralConfig(**SIZES, sliding_window=6, **overrides)
    if kind == "qwen2":
        return transformers.Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                        **overrides)
    if kind == "gpt_oss":  # one expert: no top-k routing, whose ties could flip between dtypes
        return transformers.GptOssConfig(**SIZES, head_dim=16, sliding_window=6, num_local_experts=1,
                                         num_experts_per_tok=1, layer_types=["sliding_attention", "full_attention"],
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **overrides)
    raise ValueError(kind)


def make_model(kind: str, seed: int = 0, device="cpu", dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    extra = {"experts_implementation": "eager"} if kind == "gpt_oss" else {}  # grouped_mm refuses float64
    model = transformers.AutoModelForCausalLM.from_config(make_config(kind, **overrides), attn_implementation="eager",
                                                          **extra)
    if kind == "gpt_oss":  # sinks of a trained model's size (initialised at std 0.02 they would barely show)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.normal_(0.0, 1.5)
    return model.to(device=device, dtype=dtype).eval()


def batch_with_padding(seed: int, lengths, *, left: bool, device="cpu"):
    """Random token ids (batch, max(lengths)) and their 0/1 mask, padded on the left or right."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, SIZES["vocab_size"], (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        real = slice(width - n, width) if left else slice(0, n)
        mask[b, real] = 1
    ids = ids.masked_fill(mask == 0, SIZES["pad_token_id"])
    return ids.to(device), mask.to(device)


def logits(model, impl: str, ids, mask, **kwargs):
    """Logits with ``impl``; positions count real tokens only (as generate() does), so padding
    on the left shifts nothing."""
    model.set_attn_implementation(impl)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=position_ids, **kwargs).logits


def oracle_logits(model64, ids, mask):
    """The float64 eager model run on each sequence alone, without padding: logits of the real tokens.

    (float64 eager on a left-padded batch is no oracle: a padded query row sees no key, its
    softmax of -inf is NaN and the NaN reaches real rows through 0 * NaN in the next layer.)
    """
    model64.set_attn_implementation("eager")
    rows = []
    with torch.no_grad():
        for b in range(ids.shape[0]):
            real = ids[b][mask[b].bool()][None]
            rows.append(model64(real).logits[0])
    out = torch.cat(rows)
    assert torch.isfinite(out).all()
    return out


@pytest.fixture
def cpu_backend(monkeypatch):
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt_oss"])
def test_logits_match_eager_with_left_padding(cpu_backend, kind):
    model = make_model(kind)
    oracle = copy.deepcopy(model).double()
    ids, mask = batch_with_padding(1, [20, 15, 9], left=True)
    real = mask.bool()  # padded rows of logits are garbage in eager and zeros-fed here
    ref = oracle_logits(oracle, ids, mask)
    plain = logits(model, "eager", ids, mask)[real]
    fast = logits(model, "tileattn", ids, mask)[real]
    assert_within(f"{kind} logits", fast, plain, ref)


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors reach Triton only through its interpreter; on a GPU "
                                      "test_bf16_on_cuda runs the kernels")
def test_logits_through_triton_kernels(monkeypatch):
    """The same model through the Triton kernels (the interpreter on a CPU), right padding."""
    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    model = make_model("qwen2", seed=3)
    oracle = copy.deepcopy(model).double()
    ids, mask = batch_with_padding(4, [13, 7], left=False)
    real = mask.bool()
    ref = oracle_logits(oracle, ids, mask)
    assert_within("qwen2 logits (triton)", logits(model, "tileattn", ids, mask)[real],
                  logits(model, "eager", ids, mask)[real], ref)


@pytest.mark.parametrize("kind, cache", [("llama", None), ("mistral", None), ("llama", "static"), ("mistral", "static"),
                                         ("gpt_oss", None)])
def test_generate_gives_eager_greedy_tokens(cpu_backend, kind, cache):
    """Greedy decoding with transformers' own KV caches (dynamic, sliding for mistral, static): eager's tokens."""
    model = make_model(kind, seed=5)
    ids, mask = batch_with_padding(6, [12, 7, 4], left=True)
    tokens = {}
    for impl in ("eager", "tileattn"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                          cache_implementation=cache)
    assert tokens["tileattn"].shape == (3, 22)
    assert torch.equal(tokens["tileattn"], tokens["eager"])


@pytest.mark.parametrize("kind", ["mistral", "gpt_oss"])
def test_training_step_gradients_match(cpu_backend, kind):
    """Loss and every parameter's gradient (gpt-oss: the sinks' too) of a right-padded training
    batch, against float64 eager."""
    _check_training_step("cpu", torch.float32, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mistral", "gpt_oss"])
def test_training_step_on_cuda(kind):
    """The same training step in bf16 on the GPU, through the Triton forward and backward kernels."""
    _check_training_step("cuda", torch.bfloat16, kind)


def _token_losses(model, ids, mask=None):
    """Cross-entropy of each next-token prediction, in float32 as transformers computes its loss;
    with right padding (or none) the rows' real predictions, in batch-then-position order."""
    out = model(ids, attention_mask=mask).logits[:, :-1].float()
    losses = torch.nn.functional.cross_entropy(out.transpose(1, 2), ids[:, 1:], reduction="none")
    return losses if mask is None else losses[mask[:, 1:].bool()]


def _check_training_step(device: str, dtype: torch.dtype, kind: str = "mistral") -> None:
    """Each token's loss and every parameter's gradient of the mean loss, by the tolerance rule.

    The oracle is the model's own weights in float64 with eager attention, each sequence run
    alone (see oracle_logits); eager attention in ``dtype`` on the padded batch sets the budget
    (tests/tolerance.py). Losses are compared token by token like logits: their mean, one
    scalar, would let errors cancel and make the rule a comparison of two single samples.
    """
    model = make_model(kind, seed=7, device=device, dtype=dtype).train()
    oracle = copy.deepcopy(model).double().train()
    oracle.set_attn_implementation("eager")
    ids, mask = batch_with_padding(8, [16, 11, 5], left=False, device=device)
    lengths = mask.sum(1).tolist()
    ref_losses = torch.cat([_token_losses(oracle, ids[b:b + 1, :n]).flatten() for b, n in enumerate(lengths)])
    ref_losses.mean().backward()
    ref = {n: p.grad for n, p in oracle.named_parameters()}
    assert torch.isfinite(ref_losses).all() and all(torch.isfinite(g).all() for g in ref.values())
    grads, losses = {}, {}
    for impl in ("eager", "tileattn"):
        model.zero_grad()
        model.set_attn_implementation(impl)
        token_losses = _token_losses(model, ids, mask)
        token_losses.mean().backward()
        losses[impl] = token_losses.detach()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_within("token losses", losses["tileattn"], losses["eager"], ref_losses)
    for n, g in ref.items():
        assert_within(f"grad {n}", grads["tileattn"][n], grads["eager"][n], g, factor=GRAD_FACTOR)


def test_attention_dropout_in_training(cpu_backend):
    """attention_dropout reaches tileattn in train mode only, reproducibly under torch.manual_seed."""
    model = make_model("llama", seed=9, attention_dropout=0.3)
    model.set_attn_implementation("tileattn")
    ids, mask = batch_with_padding(10, [14, 9], left=False)
    labels = ids.masked_fill(mask == 0, -100)

    def loss_with_seed(seed):
        torch.manual_seed(seed)
        return model(ids, attention_mask=mask, labels=labels).loss

    with torch.no_grad():
        evaluated = loss_with_seed(0)
    model.train()
    first = loss_with_seed(0)
    first.backward()
    assert torch.equal(first.detach(), loss_with_seed(0).detach())
    assert not torch.equal(first.detach(), loss_with_seed(1).detach())
    assert not torch.equal(first.detach(), evaluated)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_packed_row_equals_separate_sequences(cpu_backend):
    """One row holding two sequences (found from position_ids, or given as cu_seq_lens) attends per sequence."""
    model = make_model("llama", seed=11)
    model.set_attn_implementation("tileattn")
    gen = torch.Generator().manual_seed(12)
    first, second = torch.randint(1, 128, (1, 9), generator=gen), torch.randint(1, 128, (1, 6), generator=gen)
    row = torch.cat([first, second], dim=1)
    position_ids = torch.cat([torch.arange(9), torch.arange(6)])[None]
    cu = torch.tensor([0, 9, 15], dtype=torch.int32)
    with torch.no_grad():
        separate = torch.cat([model(first).logits, model(second).logits], dim=1)
        from_positions = model(row, position_ids=position_ids).logits
        from_offsets = model(row, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9,
                             max_length_k=9).logits
    # Same kernels on the same tokens: only the order of float32 sums may differ.
    torch.testing.assert_close(from_positions, separate, rtol=0, atol=1e-5)
    torch.testing.assert_close(from_offsets, separate, rtol=0, atol=1e-5)


def test_packed_rows_of_a_batch_equal_separate_sequences(cpu_backend):
    """Two rows, each holding sequences found from its position_ids (as transformers' eager and SDPA
    masks find them without a cache), and one row of positions shared by both rows: each sequence
    attends to itself alone."""
    model = make_model("llama", seed=11)
    model.set_attn_implementation("tileattn")
    ids = torch.randint(1, 128, (2, 15), generator=torch.Generator().manual_seed(14))
    lengths = [[9, 6], [4, 11]]
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    with torch.no_grad():
        separate = torch.stack([torch.cat([model(ids[b:b + 1, s:s + n]).logits[0]
                                           for s, n in zip((0, row[0]), row)]) for b, row in enumerate(lengths)])
        packed = model(ids, position_ids=position_ids, use_cache=False).logits
        shared = model(ids, position_ids=position_ids[:1], use_cache=False).logits
        shared_separate = torch.cat([model(ids[:, :9]).logits, model(ids[:, 9:]).logits], dim=1)
    torch.testing.assert_close(packed, separate, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared, shared_separate, rtol=0, atol=1e-5)


def test_packed_positions_are_read_once_per_forward(cpu_backend, monkeypatch):
    """Every layer gets the same position_ids tensor: where its sequences restart is read on the
    host once per forward, not once per layer (the model has two layers), and again for new ones."""
    model = make_model("llama", seed=11)
    model.set_attn_implementation("tileattn")
    reads = []
    restarts = tt._restarts
    monkeypatch.setattr(tt, "_restarts", lambda *a: reads.append(1) or restarts(*a))
    row = torch.randint(1, 128, (1, 15), generator=torch.Generator().manual_seed(13))
    position_ids = torch.cat([torch.arange(9), torch.arange(6)])[None]
    with torch.no_grad():
        model(row, position_ids=position_ids)
        assert len(reads) == 1 and model.config.num_hidden_layers > 1
        model(row, position_ids=position_ids.clone())
    assert len(reads) == 2


def test_compiled_forward_has_no_graph_break(cpu_backend):
    """torch.compile(fullgraph=True) traces a left-padded batch through tileattn's custom ops.

    aot_eager runs dynamo and AOTAutograd (where graph breaks and missing fake kernels show
    up) without inductor's C++ build, which would dominate the CPU budget.
    """
    model = make_model("qwen2", seed=13)
    model.set_attn_implementation("tileattn")
    ids, mask = batch_with_padding(14, [17, 10], left=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    real = mask.bool()
    with torch.no_grad():
        eager_out = model(ids, attention_mask=mask, use_cache=False).logits[real]
        compiled_out = compiled(ids, attention_mask=mask, use_cache=False).logits[real]
    # Unpadded (eager) and segmented (compiled) batches: same keys per query, sums may reorder.
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=1e-5)


@pytest.mark.parametrize("left", [True, False])
def test_segmented_padding_equals_unpadding(cpu_backend, left):
    """The compile-time path (three segments per row) gives the real query rows of the eager path."""
    gen = torch.Generator().manual_seed(19 + left)
    q, k, v = (torch.randn(3, n, h, 16, generator=gen) for n, h in ((5, 4), (11, 2), (11, 2)))
    _, mask = batch_with_padding(20, [11, 6, 3], left=left)  # queries: key positions 6..10
    keys_real = mask.bool()
    options = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(3, 3), softcap=0.0)
    exact = tt._padded_attention(q, k, v, keys_real, options)
    segmented = tt._segmented_attention(q, k, v, keys_real, 6, options)
    real_queries = keys_real[:, 6:]
    assert real_queries.any() and not real_queries.all()
    torch.testing.assert_close(segmented[real_queries], exact[real_queries], rtol=0, atol=1e-6)


class _Counted:
    """Calls of some of the integration's helpers, counted (monkeypatched in ``count_calls``)."""

    def __init__(self, monkeypatch, *names):
        self.calls = dict.fromkeys(names, 0)
        for name in names:
            monkeypatch.setattr(tt, name, self._counting(name, getattr(tt, name)))

    def _counting(self, name, f):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return f(*args, **kwargs)
        return counted


def test_a_decoding_step_reads_its_mask_once(cpu_backend, monkeypatch):
    """Every layer of a step gets the same mask tensor: where its rows' real keys lie is read on the
    host once and reused, and read again for another mask or after an in-place change of this one
    (its version counter); so is the packing of a mask off the decoding route."""
    gen = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(3, n, h, 16, generator=gen) for n, h in ((1, 4), (9, 2), (9, 2)))
    _, mask = batch_with_padding(20, [9, 4, 6], left=True)
    options = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0)
    counted = _Counted(monkeypatch, "_Runs", "_real_keys")
    first = tt._padded_attention(q, k, v, mask, options)
    second = tt._padded_attention(q, k, v, mask, options)  # the next layer
    assert counted.calls == {"_Runs": 1, "_real_keys": 0} and torch.equal(first, second)
    mask[1, 8] = 0  # row 1's last token (the query) becomes padding, in place
    changed = tt._padded_attention(q, k, v, mask, options)
    assert counted.calls == {"_Runs": 2, "_real_keys": 1} and torch.equal(changed[1], torch.zeros_like(changed[1]))
    assert torch.equal(tt._padded_attention(q, k, v, mask.clone(), options), changed)
    assert counted.calls == {"_Runs": 3, "_real_keys": 2}


class _Layer(torch.nn.Module):
    is_causal = True


def _hf_inputs(gen, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim=16, device="cpu"):
    """q (batch, nheads, seqlen_q, headdim), k, v (batch, nheads_k, seqlen_k, headdim): the layouts
    transformers hands over (its caches are contiguous in that order)."""
    return (torch.randn(batch, nheads, seqlen_q, headdim, generator=gen).to(device),
            *(torch.randn(batch, nheads_k, seqlen_k, headdim, generator=gen).to(device) for _ in range(2)))


def _assert_rows_exact(out, q, k, v, keys_real, *, scaling, window, softcap, sinks=None):
    """Each row's real queries (among the last seqlen_q key slots: with left padding, a tail of
    them) against the float64 reference over the row's real keys alone, by the tolerance rule
    (plain float32 attention sets the budget); padded query rows must be 0. Checked on the host."""
    out, q, k, v, keys_real = (t.cpu() for t in (out, q, k, v, keys_real))
    sinks = None if sinks is None else sinks.cpu()
    seqlen_q, width = q.shape[2], keys_real.shape[1]
    opts = dict(softmax_scale=scaling, causal=True, window_size=(window - 1, window - 1) if window else (-1, -1),
                softcap=softcap or 0.0)
    for b in range(q.shape[0]):
        queries = keys_real[b, width - seqlen_q:]
        n = int(queries.sum())
        assert queries[seqlen_q - n:].all(), "real queries must be the last ones: the reference below needs it"
        assert torch.equal(out[b, :seqlen_q - n], torch.zeros_like(out[b, :seqlen_q - n]))
        if n == 0:
            continue
        qb = q[b:b + 1, :, seqlen_q - n:].transpose(1, 2)  # (1, n, nheads, headdim)
        kb, vb = (x[b:b + 1, :, keys_real[b]].transpose(1, 2) for x in (k, v))
        ref, _ = R.attention_naive(qb.double().numpy(), kb.double().numpy(), vb.double().numpy(),
                                   learnable_sink=None if sinks is None else sinks.double().numpy(), **opts)
        plain, _ = plain_attention(qb, kb, vb, learnable_sink=sinks, **opts)
        assert_within(f"row {b}", out[b:b + 1, seqlen_q - n:], plain, ref)


DECODE_CASES = {  # (nheads, nheads_k, seqlen_q, sliding_window, softcap, sinks)
    "gqa": (4, 2, 1, None, None, False),
    "mha": (2, 2, 1, None, None, False),
    "mqa": (4, 1, 1, None, None, False),
    "sliding window": (4, 2, 1, 5, None, False),
    "softcap": (4, 2, 1, None, 2.0, False),
    "sinks": (4, 2, 1, None, None, True),
    "two new tokens": (4, 2, 2, 6, None, False),
}


@pytest.mark.parametrize("case", DECODE_CASES)
def test_left_padded_decoding_step_is_exact(device, monkeypatch, case):
    """A decoding step of a left-padded batch (a row without padding among them) takes the
    decoding route: no packing or gather (``_unpadded_attention`` never runs), the keys read in
    place from transformers' layout, whose padding slots hold NaN here, never read; each row
    equals the float64 reference over its real keys."""
    nheads, nheads_k, seqlen_q, window, softcap, with_sinks = DECODE_CASES[case]
    gen = torch.Generator().manual_seed(31)
    q, k, v = _hf_inputs(gen, 4, seqlen_q, 13, nheads, nheads_k, device=device)
    _, mask = batch_with_padding(32, [9, 13, 2, 5], left=True, device=device)
    keys_real = mask.bool()
    for t in (k, v):
        t.masked_fill_(~keys_real[:, None, :, None], float("nan"))
    sinks = torch.randn(nheads, generator=gen).to(device) if with_sinks else None
    monkeypatch.setattr(tt, "_unpadded_attention", lambda *a: pytest.fail("the decoding step packed its batch"))
    kwargs = dict(scaling=0.3, sliding_window=window, softcap=softcap, s_aux=sinks)
    out, _ = tt.tileattn_attention_forward(_Layer(), q, k, v, keys_real, **kwargs)
    assert out.shape == (4, seqlen_q, nheads, 16)
    _assert_rows_exact(out, q, k, v, keys_real, scaling=0.3, window=window, softcap=softcap, sinks=sinks)
    again, _ = tt.tileattn_attention_forward(_Layer(), q, k, v, keys_real, **kwargs)  # the next layer: same plan
    assert torch.equal(again, out)


OFF_ROUTE_MASKS = {  # rows of width 10; the decoding step's query is the last key slot
    "a hole": [[0, 0, 1, 1, 0, 1, 1, 1, 1, 1], [1] * 10],
    "right padding": [[1] * 6 + [0] * 4, [0, 0] + [1] * 8],
    "padding after the run": [[0, 0, 1, 1, 1, 1, 1, 1, 1, 0], [1] * 10],
}


@pytest.mark.parametrize("name", OFF_ROUTE_MASKS)
def test_masks_off_the_decoding_route_stay_exact(cpu_backend, monkeypatch, name):
    """Masks whose real keys are not one run ending at the query (holes, right padding, a padded
    query) go the packed path, exact for any mask: real rows equal the reference over their real
    keys, a padded query row is 0."""
    gen = torch.Generator().manual_seed(33)
    q, k, v = _hf_inputs(gen, 2, 1, 10, 4, 2)
    keys_real = torch.tensor(OFF_ROUTE_MASKS[name], dtype=torch.bool)
    counted = _Counted(monkeypatch, "_unpadded_attention", "DecodePlan")
    out, _ = tt.tileattn_attention_forward(_Layer(), q, k, v, keys_real, scaling=0.25)
    assert counted.calls == {"_unpadded_attention": 1, "DecodePlan": 0}
    _assert_rows_exact(out, q, k, v, keys_real, scaling=0.25, window=None, softcap=None)


def test_padded_queries_and_gradients_keep_the_packed_path(cpu_backend, monkeypatch):
    """A prefill with left padding (padded query rows) and a decoding-shaped call that autograd
    records (no gradients through a KV cache) both take the packed path, exactly."""
    gen = torch.Generator().manual_seed(35)
    _, mask = batch_with_padding(36, [7, 3], left=True)
    keys_real = mask.bool()
    counted = _Counted(monkeypatch, "_unpadded_attention", "DecodePlan")
    q, k, v = _hf_inputs(gen, 2, 7, 7, 4, 2)
    out, _ = tt.tileattn_attention_forward(_Layer(), q, k, v, keys_real, scaling=0.25)
    _assert_rows_exact(out, q, k, v, keys_real, scaling=0.25, window=None, softcap=None)
    q, k, v = (t.requires_grad_() for t in _hf_inputs(gen, 2, 1, 7, 4, 2))
    out, _ = tt.tileattn_attention_forward(_Layer(), q, k, v, keys_real, scaling=0.25)
    _assert_rows_exact(out.detach(), q.detach(), k.detach(), v.detach(), keys_real, scaling=0.25, window=None,
                       softcap=None)
    out.square().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    assert counted.calls == {"_unpadded_attention": 2, "DecodePlan": 0}


def test_generate_reads_each_steps_mask_once_and_never_packs_a_step(cpu_backend, monkeypatch):
    """generate() on a left-padded batch: the mask of each forward is read on the host once (by
    the mask function; both layers reuse it), only the prefill packs its batch, and each
    decoding step makes one plan that both layers run: the first step a new one, the others
    the last step's carried on (``DecodePlan.next_step``, which makes none anew here)."""
    model = make_model("llama", seed=37)
    model.set_attn_implementation("tileattn")
    ids, mask = batch_with_padding(38, [11, 6, 3], left=True)
    monkeypatch.setattr(tt, "_STEP_PLANS", {})  # no plan of an earlier test to carry on
    calls = {"run": 0, "_run_fitted": 0, "next_step": 0, "__init__": 0}
    for name in calls:
        monkeypatch.setattr(DecodePlan, name, _counting(calls, name, getattr(DecodePlan, name)))
    counted = _Counted(monkeypatch, "_Runs", "_pack", "_unpadded_attention", "DecodePlan")
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    layers = model.config.num_hidden_layers
    assert counted.calls == {"_Runs": 6, "_pack": 1, "_unpadded_attention": layers, "DecodePlan": 1}
    # _run_fitted: decode_plan has just compared the layer's tensors with the plan
    assert calls == {"run": 0, "_run_fitted": 5 * layers, "next_step": 4, "__init__": 1}


def _counting(calls: dict, name: str, f):
    def counted(*args, **kwargs):
        calls[name] += 1
        return f(*args, **kwargs)
    return counted


def _decode_steps(gen, pads: list[list[int]], batch_sizes: list[int], nheads=4, nheads_k=2, headdim=16,
                  grow: list[int] | None = None, dtypes: list | None = None, device="cpu"):
    """Per step: (q, k, v, bool mask) as transformers' eager generate() hands them to a layer, the
    cache one key longer each step (``grow``: per step, how many more) and fresh tensors
    (DynamicCache's torch.cat): step t's rows have pads[t] left padding slots, its batch
    batch_sizes[t], its dtype dtypes[t] (float32); padding slots of k, v hold NaN; on ``device``."""
    steps, seen = [], 9
    grow, dtypes = grow or [1] * len(pads), dtypes or [torch.float32] * len(pads)
    for pad, batch, more, dtype in zip(pads, batch_sizes, grow, dtypes):
        seen += more
        q = torch.randn(batch, nheads, 1, headdim, generator=gen).to(dtype)
        k, v = (torch.randn(batch, nheads_k, seen, headdim, generator=gen).to(dtype) for _ in "kv")
        mask = torch.arange(seen)[None] >= torch.tensor(pad)[:, None]
        for t in (k, v):
            t.masked_fill_(~mask[:, None, :, None], float("nan"))
        steps.append(tuple(t.to(device) for t in (q, k, v, mask)))
    return steps


# step by step: the left pads of each row and the batch (and optionally _decode_steps' other
# arguments); the plan carried on from step to step, or made anew where the batch or the dtype
# changes (and carried on again after)
CARRIED_STEPS = {
    "generate": ([[3, 0, 7]] * 4, [3] * 4),
    "padding changes": ([[3, 0, 7], [3, 0, 7], [0, 5, 2], [0, 5, 2]], [3] * 4),
    "batch changes": ([[3, 0, 7], [3, 0, 7], [1, 4], [1, 4]], [3, 3, 2, 2]),
    "cache grows by several keys": ([[3, 0, 7], [3, 0, 7], [4, 1, 8], [0, 0, 2]], [3] * 4, dict(grow=[1, 3, 2, 1])),
    "dtype changes": ([[3, 0, 7]] * 4, [3] * 4,
                      dict(dtypes=[torch.float32, torch.float32, torch.float16, torch.float16])),
    # the packed keys' head stride, 40 x the slot count: a multiple of 16 at every other step
    "head stride class changes": ([[3, 0, 7]] * 4, [3] * 4, dict(headdim=40)),
}


@pytest.mark.parametrize("case", CARRIED_STEPS)
@pytest.mark.parametrize("window", [None, 5])
def test_decoding_steps_carry_their_plan_exactly(device, monkeypatch, case, window):
    """Consecutive decoding steps as generate() makes them (the mask function, then two layers):
    each step's plan is the last one's carried on (``DecodePlan.next_step``), and every output
    equals, bit for bit, what a plan made anew for the step gives (the same kernels), and the
    float64 reference over the row's real keys. A step whose batch changed makes a new plan;
    one whose padding changed carries the plan on over the new pads."""
    from tileattn.gpu import attention as A

    pads, batches, more = (*CARRIED_STEPS[case], {})[:3]
    gen = torch.Generator().manual_seed(41)
    steps = _decode_steps(gen, pads, batches, **more, device=device)
    kwargs = dict(scaling=0.3, sliding_window=window)
    fresh = []
    for q, k, v, mask in steps:  # each step's plan made anew, with no plan (nor launch plan) to carry on
        monkeypatch.setattr(tt, "_STEP_PLANS", {})
        A.clear_plans()
        mask_arg = tt.tileattn_mask(q.shape[0], 1, k.shape[2], k.shape[2] - 1, attention_mask=mask)
        fresh.append(tt.tileattn_attention_forward(_Layer(), q, k, v, mask_arg, **kwargs)[0])
    monkeypatch.setattr(tt, "_STEP_PLANS", {})
    calls = {"next_step": 0, "__init__": 0}
    for name in calls:
        monkeypatch.setattr(DecodePlan, name, _counting(calls, name, getattr(DecodePlan, name)))
    for t, (q, k, v, mask) in enumerate(steps):
        mask_arg = tt.tileattn_mask(q.shape[0], 1, k.shape[2], k.shape[2] - 1, attention_mask=mask.clone())
        out, _ = tt.tileattn_attention_forward(_Layer(), q, k, v, mask_arg, **kwargs)
        again, _ = tt.tileattn_attention_forward(_Layer(), q, k.clone(), v.clone(), mask_arg, **kwargs)  # layer 2
        assert torch.equal(out, fresh[t]) and torch.equal(again, out), f"step {t}"
        _assert_rows_exact(out, q, k, v, mask, scaling=0.3, window=window, softcap=None)
    kinds = [(q.shape[0], q.dtype) for q, *_ in steps]
    renewed = sum(a != b for a, b in zip(kinds[1:], kinds[:-1]))  # next_step makes a new plan
    assert calls == {"next_step": len(steps) - 1, "__init__": 1 + renewed}


def test_segmented_path_refuses_a_mask_with_holes(cpu_backend):
    """The compile-time path cannot cut a row whose real tokens are not one run: it must fail, not guess."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, n, 2, 16, generator=gen) for n in (4, 8, 8))
    keys_real = torch.ones(2, 8, dtype=torch.bool)
    keys_real[1, 2] = False  # a hole in the middle of row 1
    options = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0)
    with pytest.raises(RuntimeError, match="one run"):
        tt._segmented_attention(q, k, v, keys_real, 4, options)


def test_unsupported_requests_raise(cpu_backend):
    model = make_model("llama", seed=15)
    model.set_attn_implementation("tileattn")
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(16))
    custom = torch.zeros(1, 1, 8, 8)
    with pytest.raises(ValueError, match="2-D padding mask"):
        model(ids, attention_mask=custom)
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)


def test_register_is_idempotent_and_import_is_lazy():
    tt.register()
    tt.register()
    assert transformers.AttentionInterface._global_mapping[tt.NAME] is tt.tileattn_attention_forward
    code = "import sys, tileattn; assert 'transformers' not in sys.modules, 'tileattn imported transformers'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("version", ["4.53.0", "5.3.0"])
def test_register_refuses_a_transformers_whose_mask_functions_take_cache_position(monkeypatch, version):
    """transformers 4.53-5.3 call a mask function with cache_position, not q_length / q_offset: the
    first call of a model would fail inside transformers with a TypeError, so registering refuses."""
    # the module register() imports now (sys.modules' entry: an earlier test's import may have replaced it)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    with pytest.raises(ImportError, match=f"5.4 or later .*found {version}"):
        tt.register()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_bf16_on_cuda(kind):
    """bf16 on the GPU: logits by the rule, greedy tokens the float64 model agrees with, compiled forward."""
    model = make_model(kind, seed=17, device="cuda", dtype=torch.bfloat16)
    oracle = make_model(kind, seed=17, device="cuda", dtype=torch.float64)
    ids, mask = batch_with_padding(18, [40, 33, 12], left=True, device="cuda")
    real = mask.bool()
    ref = oracle_logits(oracle, ids, mask)
    plain = logits(model, "eager", ids, mask)[real]
    assert_within(f"{kind} bf16 logits", logits(model, "tileattn", ids, mask)[real], plain, ref)
    budget = 2 * (plain.double() - ref).abs().max().item() + 1e-5

    model.set_attn_implementation("tileattn")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
        full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1]:])], dim=1)
        ref_full = torch.zeros(*out.sequences.shape, SIZES["vocab_size"], dtype=torch.float64, device="cuda")
        ref_full[full_mask.bool()] = oracle_logits(oracle, out.sequences, full_mask)
        ref_steps = ref_full[:, ids.shape[1] - 1:-1]
    chosen = out.sequences[:, ids.shape[1]:]
    # Each greedy token is the float64 argmax up to the bf16 error budget (near-ties may go either way).
    gap = ref_steps.max(-1).values - ref_steps.gather(-1, chosen[..., None]).squeeze(-1)
    assert (gap <= 2 * budget).all(), f"greedy token off the float64 argmax by {gap.max():.3e}"
    cached = torch.stack(out.logits, dim=1).double()
    assert (cached - ref_steps).abs().max().item() <= budget

    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        dense = ids[:1, :32]
        torch.testing.assert_close(compiled(dense, use_cache=False).logits.double(),
                                   oracle(dense, use_cache=False).logits, rtol=0, atol=budget)


def test_static_cache_mask_keeps_one_shape_and_compiles_once(cpu_backend):
    """With a static cache the mask keeps the cache's width as tokens arrive (a growing mask would
    recompile generate()'s compiled decoding step for every token), and the compile-time path
    reads the query offset from it on the device, matching the eager path."""
    from torch._dynamo.testing import CompileCounter

    gen = torch.Generator().manual_seed(23)
    slots, heads = 16, (4, 2)
    k, v = (torch.randn(3, slots, heads[1], 16, generator=gen) for _ in range(2))
    q = torch.randn(3, 1, heads[0], 16, generator=gen)
    options = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0)
    counter = CompileCounter()
    compiled = torch.compile(tt._padded_attention, backend=counter, fullgraph=True)
    for seen in (10, 11, 13):  # tokens so far: left padding, then generated tokens
        _, mask = batch_with_padding(24, [seen, seen - 4, seen - 7], left=True)
        fixed = tt.tileattn_mask(3, 1, slots, q_offset=torch.tensor(seen - 1), attention_mask=mask)
        assert fixed.shape == (3, slots) and fixed.dtype == torch.int8
        assert torch.equal(fixed[:, seen:], torch.full((3, slots - seen), -1, dtype=torch.int8))
        eager = tt._padded_attention(q, k, v, fixed, options)
        torch.testing.assert_close(compiled(q, k, v, fixed, options), eager, rtol=0, atol=1e-6)
        # the same rows as the growing bool mask gives
        torch.testing.assert_close(eager, tt._padded_attention(q, k, v, mask.bool(), options), rtol=0, atol=0)
    assert counter.frame_count == 1


def test_cross_attention_of_an_encoder_decoder_matches_eager(cpu_backend):
    """An encoder-decoder (BART) with a padded encoder batch: its decoder's queries attend to the
    encoder's real keys, whatever the decoder's length (shorter, as long, longer: none of its
    queries is a column of the encoder's mask), in one forward and in generate()."""
    config = transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, max_position_embeddings=64, pad_token_id=1, eos_token_id=2,
                                     bos_token_id=0, decoder_start_token_id=2, forced_eos_token_id=None)
    torch.manual_seed(41)
    model = transformers.BartForConditionalGeneration(config).eval()
    oracle = copy.deepcopy(model).double()
    oracle.set_attn_implementation("eager")
    gen = torch.Generator().manual_seed(42)
    ids = torch.randint(3, 128, (3, 12), generator=gen)
    mask = torch.tensor([[1] * 12, [1] * 8 + [0] * 4, [0] * 9 + [1] * 3])
    for decoder_length in (7, 12, 15):
        decoder_ids = torch.randint(3, 128, (3, decoder_length), generator=gen)
        inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
        with torch.no_grad():
            ref = oracle(**inputs).logits
            model.set_attn_implementation("eager")
            plain = model(**inputs).logits
            model.set_attn_implementation("tileattn")
            fast = model(**inputs).logits
        assert_within(f"decoder logits ({decoder_length} queries)", fast, plain, ref)
    tokens = {}
    for impl in ("eager", "tileattn"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                          do_sample=False, num_beams=1)
    assert torch.equal(tokens["tileattn"], tokens["eager"])


def test_segmented_path_keeps_every_query_of_a_cross_attention(cpu_backend):
    """The compile-time path over a mask of keys only (non-causal, no window): every query attends
    to its row's real keys, as the eager path does, for fewer or more queries than keys."""
    gen = torch.Generator().manual_seed(43)
    _, mask = batch_with_padding(44, [9, 5, 2], left=False)
    keys_real = mask.bool()
    options = dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0)
    for seqlen_q in (4, 13):
        q = torch.randn(3, seqlen_q, 4, 16, generator=gen)
        k, v = (torch.randn(3, 9, 2, 16, generator=gen) for _ in range(2))
        exact = tt._padded_attention(q, k, v, keys_real, options)
        for b in range(3):
            kb, vb = (x[b:b + 1, keys_real[b]] for x in (k, v))
            ref, _ = R.attention_naive(q[b:b + 1].double().numpy(), kb.double().numpy(), vb.double().numpy(),
                                       causal=False)
            plain, _ = plain_attention(q[b:b + 1], kb, vb, causal=False)
            assert_within(f"row {b}", exact[b:b + 1], plain, ref)
        segmented = tt._segmented_attention(q, k, v, keys_real, None, options)
        torch.testing.assert_close(segmented, exact, rtol=0, atol=1e-6)


def test_two_threads_decoding_at_once_share_no_split_workspace(monkeypatch):
    """Two generate() calls in two threads, with the same shapes and options: one thread's step
    must not carry on the other's plan (``_STEP_PLANS``), whose split workspace it would then
    share while both are in flight. The launches interleave here as two threads' launches may on
    one stream: both split launches, then both combines; each thread's output must be its own.
    The Triton kernels on the GPU when there is one, else in Triton's interpreter."""
    import threading
    import time

    from tileattn.gpu import attention as A

    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    monkeypatch.setattr(A, "_auto_splits", lambda *a, **kw: 2)  # split launches at this small size too
    A.clear_plans()
    gen = torch.Generator().manual_seed(44)
    steps = _decode_steps(gen, [[3, 0, 7], [1, 4, 2]], [3, 3], device="cuda" if HAS_CUDA else "cpu")

    def step(i, outs):
        q, k, v, mask = steps[i]
        mask_arg = tt.tileattn_mask(q.shape[0], 1, k.shape[2], k.shape[2] - 1, attention_mask=mask.clone())
        outs[i] = tt.tileattn_attention_forward(_Layer(), q, k, v, mask_arg, scaling=0.3)[0]

    want = {}
    for i in range(2):  # each alone
        monkeypatch.setattr(tt, "_STEP_PLANS", {})
        step(i, want)
    assert not torch.equal(want[0], want[1])
    monkeypatch.setattr(tt, "_STEP_PLANS", {})
    barrier, lock, run = threading.Barrier(2, timeout=120), threading.Lock(), A.FwdPlan.run

    def interleaved(self, q, k, v, out, lse, params, alibi, cu_q, cu_k, used, table, workspace=None, **kw):
        run(self, q, k, v, out, lse, params, alibi, cu_q, cu_k, used, table, workspace, combine=False, **kw)
        barrier.wait()  # the other thread's split launch too, before either combine
        with lock:
            self.combine(self.combine_grid, *workspace, out, lse, kw.get("learnable_sink"), *self.combine_ints)

    monkeypatch.setattr(A.FwdPlan, "run", interleaved)
    got = {}
    try:
        first = threading.Thread(target=step, args=(0, got))
        first.start()
        deadline = time.monotonic() + 120
        while barrier.n_waiting < 1 and first.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # the first thread's plan made, its split launch done
        second = threading.Thread(target=step, args=(1, got))
        second.start()
        first.join()
        second.join()
    finally:
        A.clear_plans()  # no split plan made under the patched split count for later tests
    assert set(got) == {0, 1}
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_step_carries_on_only_its_own_threads_and_streams_plan(device, monkeypatch):
    """``_STEP_PLANS`` hands a step the last plan of the same owner (``_step_owner``: the thread, and
    on a GPU the current stream) only: a step of another owner makes its plan anew (it would share
    the split workspace of a generate() that may be in flight), and its own next step carries on."""
    gen = torch.Generator().manual_seed(45)
    steps = _decode_steps(gen, [[3, 0], [3, 0], [3, 0]], [2, 2, 2], device=device)
    owners = iter([("thread a", 0, False), ("thread a", 7, False), ("thread a", 7, False)])  # step 2: another stream
    monkeypatch.setattr(tt, "_step_owner", lambda device: next(owners))
    monkeypatch.setattr(tt, "_STEP_PLANS", {})
    calls = {"next_step": 0, "__init__": 0}
    for name in calls:
        monkeypatch.setattr(DecodePlan, name, _counting(calls, name, getattr(DecodePlan, name)))
    for q, k, v, mask in steps:
        mask_arg = tt.tileattn_mask(q.shape[0], 1, k.shape[2], k.shape[2] - 1, attention_mask=mask.clone())
        tt.tileattn_attention_forward(_Layer(), q, k, v, mask_arg, scaling=0.3)
    assert calls == {"next_step": 1, "__init__": 2}


def test_a_plan_made_under_inference_mode_is_not_carried_out_of_it(device, monkeypatch):
    """A step outside ``torch.inference_mode`` makes its plan anew rather than carry on one made
    under it (whose workspace, an inference tensor, it may not write), and a step back under it does
    not carry on the plan made outside."""
    gen = torch.Generator().manual_seed(46)
    steps = _decode_steps(gen, [[3, 0], [3, 0], [3, 0]], [2, 2, 2], device=device)
    monkeypatch.setattr(tt, "_STEP_PLANS", {})
    calls = {"next_step": 0, "__init__": 0}
    for name in calls:
        monkeypatch.setattr(DecodePlan, name, _counting(calls, name, getattr(DecodePlan, name)))
    for t, (q, k, v, mask) in enumerate(steps):
        with torch.inference_mode(t != 1):
            mask_arg = tt.tileattn_mask(q.shape[0], 1, k.shape[2], k.shape[2] - 1, attention_mask=mask.clone())
            tt.tileattn_attention_forward(_Layer(), q, k, v, mask_arg, scaling=0.3)
    assert calls == {"next_step": 0, "__init__": 3}
