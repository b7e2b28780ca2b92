"""A minimal serving loop on tileattn: paged KV cache, varlen prefill, graph-captured decoding.

    python examples/serve.py                       # CPU, fp32, a few seconds
    python examples/serve.py --device cuda         # GPU, bf16, decoding replayed from a CUDA graph

A tiny random Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP; no downloads) serves a queue of prompts of different lengths with a fixed
number of batch slots (continuous batching):

1. admit: waiting prompts take the free slots; they are packed into one (total, ...) batch
   and prefilled with ``flash_attn_varlen_func`` (causal per prompt), their keys and values
   scattered into a ``PagedKVCache`` with ``write_packed``; the last position's logits give
   each prompt its first new token (greedy).
2. decode: every slot advances one token with ``flash_attn_with_kvcache``, which appends the
   new key/value to the paged cache in place and attends over the whole sequence. The step
   has fixed shapes — (slots,) tokens, positions and lengths, (slots, max_blocks) block
   table — so on a GPU it is captured once in a CUDA graph and replayed; an idle slot points
   at a scratch block of its own and computes a token nobody reads.
3. retire: a request that has produced its number of tokens frees its blocks, and its slot
   goes back to step 1.

Options a serving engine would switch on:

* ``--mixed``: steps 1 and 2 become one step whose batch mixes the new prompts (their whole
  prompt as one chunk) with the decoding slots; per layer, one ``flash_attn_varlen_func`` call
  over the paged cache (``seqused_k``, ``block_table``, ``out=``), as vLLM calls flash-attn.
  Shapes vary, so it runs eagerly.
* ``--fp8-cache``: the cache holds float8_e4m3fn keys and values, quantised as they are written
  (one descale per KV head, ``FP8_DESCALE``); attention reads them with ``k_descale``/``v_descale``.
* ``--shared-prefix N``: every prompt starts with the same N-token system prompt, prefilled
  once into blocks of its own; each request caches only its own tokens and attends with
  ``cascade_attn_with_kvcache`` (the prefix's keys read once for all slots); with
  ``--fp8-cache`` too.

At the end every answer is checked against a recomputation of the full sequence with plain
causal ``flash_attn_func`` (no cache): the greedy token must be the recomputed argmax up to
rounding (an FP8 cache rounds keys and values to 3 mantissa bits: its gaps are larger).
Prints the throughput (tokens/s) of each phase.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tileattn import (PagedKVCache, cascade_attn_with_kvcache, flash_attn_func, flash_attn_varlen_func,
                      flash_attn_with_kvcache)
from tileattn.cli import Parser, at_least  # the CLI's one-line refusals and integer bounds
from tileattn.ops.fp8 import FP8_DTYPE

FP8_DESCALE = 8.0 / 448  # keys and values of this tiny model stay within +-8: e4m3's range scaled to it


@dataclass
class Config:
    vocab: int = 256
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 256
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class TinyDecoder(torch.nn.Module):
    """Llama-style decoder with random weights; attention is left to the caller (prefill / decode)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden, cfg.head_dim

        def linear(n_in, n_out):
            return torch.nn.Parameter(torch.randn(n_out, n_in) / math.sqrt(n_in))

        self.embed = torch.nn.Parameter(torch.randn(cfg.vocab, d))
        self.wq = torch.nn.ParameterList(linear(d, cfg.heads * hd) for _ in range(cfg.layers))
        self.wkv = torch.nn.ParameterList(linear(d, 2 * cfg.kv_heads * hd) for _ in range(cfg.layers))
        self.wo = torch.nn.ParameterList(linear(cfg.heads * hd, d) for _ in range(cfg.layers))
        self.w_gate_up = torch.nn.ParameterList(linear(d, 2 * cfg.ffn) for _ in range(cfg.layers))
        self.w_down = torch.nn.ParameterList(linear(cfg.ffn, d) for _ in range(cfg.layers))
        self.lm_head = linear(d, cfg.vocab)
        inv_freq = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate (x1, x2) halves of x (..., heads, head_dim) by angle position * inv_freq."""
        angle = positions.float()[..., None] * self.inv_freq  # (..., head_dim / 2)
        cos, sin = angle.cos()[..., None, :].to(x.dtype), angle.sin()[..., None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Logits of tokens (...,) at positions (...,); ``attend(layer, q, k, v)`` does attention.

        q (..., heads, head_dim), k and v (..., kv_heads, head_dim) -> (..., heads, head_dim).
        """
        cfg = self.cfg
        x = self.embed[tokens]
        for layer in range(cfg.layers):
            h = F.rms_norm(x, (cfg.hidden,))
            q = self.rope((h @ self.wq[layer].T).unflatten(-1, (cfg.heads, cfg.head_dim)), positions)
            k, v = (h @ self.wkv[layer].T).unflatten(-1, (2, cfg.kv_heads, cfg.head_dim)).unbind(-3)
            k = self.rope(k, positions)
            x = x + attend(layer, q, k, v).flatten(-2) @ self.wo[layer].T
            gate, up = (F.rms_norm(x, (cfg.hidden,)) @ self.w_gate_up[layer].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.w_down[layer].T
        return F.rms_norm(x, (cfg.hidden,)) @ self.lm_head.T


class Server:
    """Continuous batching over ``slots`` decoding slots and one PagedKVCache."""

    def __init__(self, model: TinyDecoder, *, slots: int, num_blocks: int, block_size: int, max_len: int,
                 use_graph: bool, fp8: bool = False, prefix: list[int] | None = None):
        cfg, device = model.cfg, model.embed.device
        self.model, self.slots = model, slots
        self.cache = PagedKVCache(cfg.layers, num_blocks, block_size, cfg.kv_heads, cfg.head_dim,
                                  dtype=FP8_DTYPE if fp8 else model.embed.dtype, device=device)
        # an FP8 cache: one descale per (slot, KV head), the same for all here
        self.scales = dict(k_descale=torch.full((slots, cfg.kv_heads), FP8_DESCALE, device=device),
                           v_descale=torch.full((slots, cfg.kv_heads), FP8_DESCALE, device=device)) if fp8 else {}
        self.prefix_len = 0
        if prefix:  # the shared system prompt, prefilled once; requests then cache only their own tokens
            self.prefix_len = len(prefix)
            self.prefix_seq = self.cache.allocate()
            self.cache.reserve([self.prefix_seq], len(prefix))
            self._prefill([self.prefix_seq], [prefix], shared=False)
            self.prefix_table = self.cache.block_table([self.prefix_seq])[0]
            self.prefix_lens = torch.tensor([self.prefix_len], dtype=torch.int32, device=device)
        # Where each idle slot writes its throw-away key/value: one scratch sequence per slot, as
        # the cache refuses a sequence named twice in one block table.
        self.scratch = [self.cache.allocate() for _ in range(slots)]
        self.cache.reserve(self.scratch, 1)
        self.occupant: list[dict | None] = [None] * slots
        # The decoding step's inputs live in fixed buffers, so a captured graph can replay them.
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.table = torch.zeros(slots, -(-max_len // block_size), dtype=torch.int32, device=device)
        self.seqlens = torch.zeros(slots, dtype=torch.int32, device=device)
        self.graph, self.next_tokens = None, None
        if use_graph:
            self._capture()

    def _decode_step(self) -> torch.Tensor:
        """One token for every slot: (slots,) greedy next tokens. Fixed shapes, no host sync."""
        def attend(layer, q, k, v):  # q (slots, heads, d), k, v (slots, kv_heads, d)
            kc, vc = self.cache.k_cache[layer], self.cache.v_cache[layer]
            if self.prefix_len:
                out = cascade_attn_with_kvcache(q[:, None], kc, vc, self.prefix_table, self.prefix_lens, self.table,
                                                self.seqlens, k=k[:, None], v=v[:, None], causal=True,
                                                **self._cascade_scales(self.slots))
            else:
                out = flash_attn_with_kvcache(q[:, None], kc, vc, k=k[:, None], v=v[:, None],
                                              cache_seqlens=self.seqlens, block_table=self.table, causal=True,
                                              **self.scales)
            return out[:, 0]

        return self.model(self.tokens, self.positions, attend).argmax(-1)

    def _capture(self) -> None:
        self._load_step_inputs()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture
            self._decode_step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.next_tokens = self._decode_step()

    def _slot_ids(self) -> list[int]:
        return [r["seq"] if r else scratch for r, scratch in zip(self.occupant, self.scratch)]

    def _load_step_inputs(self) -> None:
        ids = self._slot_ids()
        self.cache.block_table(ids, out=self.table)
        self.cache.seqlens(ids, out=self.seqlens)
        last = [r["out"][-1] if r else 0 for r in self.occupant]
        self.tokens.copy_(torch.tensor(last))
        self.positions.copy_(self.seqlens + self.prefix_len)  # the new token's position = tokens before it

    def admit(self, waiting: list[dict]) -> int:
        """Prefill waiting requests into free slots (one packed varlen batch); returns tokens prefilled."""
        free = [i for i, r in enumerate(self.occupant) if r is None]
        batch = [waiting.pop(0) for _ in free[:len(waiting)]]
        if not batch:
            return 0
        for slot, req in zip(free, batch):
            req["seq"] = self.cache.allocate()
            self.occupant[slot] = req
        first = self._prefill([r["seq"] for r in batch], [r["prompt"][self.prefix_len:] for r in batch])
        for req, tok in zip(batch, first):
            req["out"].append(tok)
        return sum(len(r["prompt"]) - self.prefix_len for r in batch)

    def _prefill(self, ids: list[int], prompts: list[list[int]], shared: bool = True) -> list[int]:
        """Prefill prompts into sequences ``ids`` (one packed batch); returns each one's first greedy token.

        With a shared prefix (``shared`` and ``--shared-prefix``) the prompts continue it: their
        positions start after it and each attends to it through ``cascade_attn_with_kvcache``.
        """
        device = self.model.embed.device
        lengths = [len(p) for p in prompts]
        for seq_id, n in zip(ids, lengths):
            self.cache.reserve([seq_id], n)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        tokens = torch.tensor([t for p in prompts for t in p], device=device)
        offset = self.prefix_len if shared else 0
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device) + offset
        scales = {name: d[:len(ids)] for name, d in self.scales.items()}

        def attend(layer, q, k, v):  # packed (total, heads, d)
            self.cache.write_packed(layer, ids, k, v, cu, **scales)
            if not (shared and self.prefix_len):
                return flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
            kc, vc = self.cache.k_cache[layer], self.cache.v_cache[layer]
            return torch.cat([cascade_attn_with_kvcache(
                q[None, cu[b]:cu[b + 1]], kc, vc, self.prefix_table, self.prefix_lens, self.cache.block_table([i]),
                torch.tensor([lengths[b]], dtype=torch.int32, device=device), causal=True,
                **self._cascade_scales(1))[0] for b, i in enumerate(ids)])

        logits = self.model(tokens, positions, attend)
        for seq_id, n in zip(ids, lengths):
            self.cache.advance([seq_id], n)
        return logits[cu[1:].long() - 1].argmax(-1).tolist()

    def _cascade_scales(self, batch: int) -> dict:
        """An FP8 cache's descales for cascade attention: the requests' and the prefix's (all equal here)."""
        if not self.scales:
            return {}
        return {**{name: d[:batch] for name, d in self.scales.items()},
                **{f"prefix_{name}": d[:1] for name, d in self.scales.items()}}

    def mixed_step(self, waiting: list[dict]) -> tuple[int, int, list[dict]]:
        """One step of one packed batch: new prompts whole and one token of every decoding slot, each
        layer's attention one ``flash_attn_varlen_func`` call over the paged cache. Returns
        (prompt tokens, decoded tokens, finished requests)."""
        device = self.tokens.device
        new = []
        for slot in range(self.slots):
            if self.occupant[slot] is None and waiting:
                req = waiting.pop(0)
                req["seq"] = self.cache.allocate()
                self.occupant[slot] = req
                new.append(req)
        active = [r for r in self.occupant if r is not None]
        chunks = [r["prompt"] if r in new else r["out"][-1:] for r in active]
        ids, lengths = [r["seq"] for r in active], [len(c) for c in chunks]
        before = [self.cache.length(i) for i in ids]
        for seq_id, n in zip(ids, lengths):
            self.cache.reserve([seq_id], n)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        tokens = torch.tensor([t for c in chunks for t in c], device=device)
        positions = torch.cat([torch.arange(b, b + n) for b, n in zip(before, lengths)]).to(device)
        table, used = self.cache.block_table(ids), self.cache.seqlens(ids) + cu.diff()
        max_keys = max(b + n for b, n in zip(before, lengths))
        scales = {name: d[:len(ids)] for name, d in self.scales.items()}
        out = torch.empty(tokens.shape[0], self.model.cfg.heads, self.model.cfg.head_dim, device=device,
                          dtype=self.model.embed.dtype)

        def attend(layer, q, k, v):  # packed (total, heads, d): write the new keys, then one call
            self.cache.write_packed(layer, ids, k, v, cu, **scales)
            return flash_attn_varlen_func(q, self.cache.k_cache[layer], self.cache.v_cache[layer], cu, None,
                                          max(lengths), max_keys, seqused_k=used, block_table=table, causal=True,
                                          out=out, **scales)  # (consumed before the next layer writes out)

        logits = self.model(tokens, positions, attend)
        for seq_id, n in zip(ids, lengths):
            self.cache.advance([seq_id], n)
        done = []
        next_tokens = iter(logits[cu[1:].long() - 1].argmax(-1).tolist())
        for slot, req in enumerate(self.occupant):
            if req is None:
                continue
            req["out"].append(next(next_tokens))
            if len(req["out"]) == req["max_new"]:
                self.cache.free(req["seq"])
                self.occupant[slot] = None
                done.append(req)
        prompt_tokens = sum(len(r["prompt"]) for r in new)
        return prompt_tokens, len(active) - len(new), done

    def decode(self) -> list[dict]:
        """Advance every occupied slot by one token; returns the requests that finished."""
        active = [r["seq"] for r in self.occupant if r]
        self.cache.reserve(active, 1)
        self._load_step_inputs()
        if self.graph is not None:
            self.graph.replay()
            next_tokens = self.next_tokens
        else:
            next_tokens = self._decode_step()
        self.cache.advance(active, 1)
        done = []
        for slot, (req, tok) in enumerate(zip(self.occupant, next_tokens.tolist())):
            if req is None:
                continue
            req["out"].append(tok)
            if len(req["out"]) == req["max_new"]:
                self.cache.free(req["seq"])
                self.occupant[slot] = None
                done.append(req)
        return done


def check(model: TinyDecoder, req: dict) -> float:
    """Largest gap between a greedy token's recomputed logit and the recomputed maximum (0 = exact argmax)."""
    seq = torch.tensor(req["prompt"] + req["out"][:-1], device=model.embed.device)
    logits = model(seq[None], torch.arange(len(seq), device=seq.device)[None],
                   lambda layer, q, k, v: flash_attn_func(q, k, v, causal=True))[0, len(req["prompt"]) - 1:]
    chosen = torch.tensor(req["out"], device=seq.device)
    return float((logits.max(-1).values - logits.gather(-1, chosen[:, None])[:, 0]).max())


at_least_one = at_least(1)


def a_device(text: str) -> torch.device:
    """An argparse type: "cpu", or "cuda" / "cuda:N" where that GPU exists."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA GPU is available here (torch {torch.__version__}); "
                                         "use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=a_device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu (fp32) or cuda (bf16); default: cuda when a GPU is present, else cpu")
    parser.add_argument("--requests", type=at_least_one, default=6, help="prompts to serve (default 6)")
    parser.add_argument("--slots", type=at_least_one, default=4,
                        help="requests decoded at once, the batch of each decoding step (default 4)")
    parser.add_argument("--max-new", type=at_least(2), default=32,
                        help="new tokens of the longest answer, 2 or more; the others are shorter, at least 2 "
                             "(default 32)")
    parser.add_argument("--block-size", type=at_least_one, default=16,
                        help="tokens per block of the paged KV cache (default 16)")
    parser.add_argument("--no-graph", action="store_true", help="on CUDA, decode without a CUDA graph")
    parser.add_argument("--mixed", action="store_true",
                        help="prompts and decoding slots in one batch, one attention call per layer")
    parser.add_argument("--fp8-cache", action="store_true", help="keep keys and values in float8_e4m3fn")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                        help="every prompt starts with the same N-token system prompt, cached once "
                             "(cascade attention; not with --mixed)")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shared_prefix < 0:
        parser.error(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
    if args.shared_prefix and args.mixed:
        parser.error("--shared-prefix does not combine with --mixed")
    device = args.device
    # bf16 on a GPU; fp32 on a CPU, except with an FP8 cache, whose queries are bf16/fp16
    dtype = torch.bfloat16 if device.type == "cuda" or args.fp8_cache else torch.float32
    torch.manual_seed(0)
    model = TinyDecoder(Config()).to(device=device, dtype=dtype)
    # inv_freq stays float32 (positions * inv_freq in low precision would lose the angle).
    model.inv_freq = model.inv_freq.float()

    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, model.cfg.vocab, (args.shared_prefix,), generator=gen).tolist()
    waiting = []
    for i in range(args.requests):
        n_prompt = int(torch.randint(3, 40, (1,), generator=gen))
        prompt = system + torch.randint(0, model.cfg.vocab, (n_prompt,), generator=gen).tolist()
        max_new = max(2, args.max_new * (i % 4 + 1) // 4)  # answers of different lengths
        waiting.append({"id": i, "prompt": prompt, "max_new": max_new, "out": []})
    max_len = max(len(r["prompt"]) + r["max_new"] for r in waiting)
    max_len -= len(system)  # what a request caches itself
    prefix_blocks = -(-len(system) // args.block_size)
    # + one scratch block per slot, and the shared prefix's blocks
    blocks_needed = args.slots * (-(-max_len // args.block_size) + 1) + prefix_blocks
    use_graph = device.type == "cuda" and not args.no_graph and not args.mixed
    # no_grad, not inference_mode: PagedKVCache marks the block tables it fills by their version
    # counter, which inference tensors lack.
    with torch.no_grad():
        server = Server(model, slots=args.slots, num_blocks=blocks_needed, block_size=args.block_size,
                        max_len=max_len, use_graph=use_graph, fp8=args.fp8_cache, prefix=system)
        finished, prefill_tokens, decode_tokens = [], 0, 0
        prefill_s = decode_s = 0.0
        while args.mixed and (waiting or any(server.occupant)):
            start = time.perf_counter()
            prompt_tokens, decoded, done = server.mixed_step(waiting)  # reads its tokens: synchronised
            decode_s += time.perf_counter() - start
            prefill_tokens, decode_tokens = prefill_tokens + prompt_tokens, decode_tokens + decoded
            finished += done
        while waiting or any(server.occupant):
            start = time.perf_counter()
            prefill_tokens += server.admit(waiting)
            if device.type == "cuda":
                torch.cuda.synchronize()
            mid = time.perf_counter()
            decode_tokens += sum(r is not None for r in server.occupant)
            finished += server.decode()
            decode_s += time.perf_counter() - mid  # decode() reads its tokens: synchronised
            prefill_s += mid - start
        worst = max(check(model, r) for r in finished)

    cache = "float8_e4m3fn" if args.fp8_cache else str(dtype).replace("torch.", "")
    print(f"device {device}, {dtype}, {args.requests} requests over {args.slots} slots, "
          f"CUDA graph: {'yes' if use_graph else 'no'}")
    print(f"KV cache {cache}" + (f", shared prefix of {len(system)} tokens (cascade)" if system else "")
          + (", one attention call per layer and step (--mixed)" if args.mixed else ""))
    for r in sorted(finished, key=lambda r: r["id"]):
        first = " ".join(map(str, r["out"][:6]))
        print(f"  request {r['id']}: {len(r['prompt']):3d} prompt -> {len(r['out']):3d} new tokens: {first} ...")
    if args.mixed:
        print(f"mixed steps: {prefill_tokens} prompt + {decode_tokens} decoded tokens, "
              f"{(prefill_tokens + decode_tokens) / decode_s:,.0f} tokens/s")
    else:
        print(f"prefill: {prefill_tokens} tokens, {prefill_tokens / prefill_s:,.0f} tokens/s")
        print(f"decode:  {decode_tokens} tokens, {decode_tokens / decode_s:,.0f} tokens/s")
    print(f"blocks free after serving: {server.cache.free_blocks} of {blocks_needed} "
          f"({args.slots} scratch{f', {prefix_blocks} shared prefix' if system else ''})")
    print(f"check against a full recompute: largest logit gap of a greedy token {worst:.2e}")


if __name__ == "__main__":
    main()
