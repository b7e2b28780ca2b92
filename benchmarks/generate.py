"""generate() throughput of a Llama-style model: tileattn vs SDPA vs eager attention, eager and compiled.

Random weights from a config (no downloads): hidden 1024, 4 layers (2 with --quick),
16 query heads over 4 KV heads (hdim 64), vocab 32000, bf16. A batch of 8 prompts of 96 to
512 tokens, left padded, decodes 128 new tokens greedily (no EOS), so every row produces
the same number of tokens:

* ``eager``: transformers' dynamic KV cache, nothing compiled;
* ``compiled``: the static KV cache, with which generate() compiles the decoding step
  (``CompileConfig(fullgraph=True)``, inductor, CUDA graphs): any graph break fails the row.

tokens/s = batch x new tokens / wall time of one generate() call (prefill included), the
median of 3 calls after a warm-up call (which also compiles); every implementation is warmed
up first, then the timed calls alternate between them round by round. ``same tokens`` is the share
of generated tokens equal to SDPA's in the same mode (bf16 rounding may flip near-ties).
About 40 s of GPU time, mostly compilation.

    python benchmarks/generate.py [--quick] [--smoke] [--out DIR] [--dry-run] [--impls a,b] [--modes m]
"""

from __future__ import annotations

import statistics
import time

import common

IMPLS = ("tileattn", "sdpa", "eager")
MODES = ("eager", "compiled")


def build_case(args) -> dict:
    if args.smoke:
        return dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=128, prompts=(9, 5, 14), new=8)
    layers = 2 if args.quick else 4
    prompts = (512, 96, 384, 200, 448, 128, 320, 256)
    return dict(hidden=1024, layers=layers, heads=16, kv_heads=4, ffn=2816, vocab=32000, prompts=prompts, new=128)


def make_model(case: dict, device: str):
    import torch
    import transformers

    import tileattn.integrations.transformers  # noqa: F401  (registers "tileattn")

    cfg = transformers.LlamaConfig(
        vocab_size=case["vocab"], hidden_size=case["hidden"], intermediate_size=case["ffn"],
        num_hidden_layers=case["layers"], num_attention_heads=case["heads"], num_key_value_heads=case["kv_heads"],
        max_position_embeddings=4096, eos_token_id=None, pad_token_id=0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def make_batch(case: dict, device: str):
    """Random prompts, left padded: (ids, mask) of shape (batch, longest prompt)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    width = max(case["prompts"])
    ids = torch.zeros(len(case["prompts"]), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(case["prompts"]):
        ids[b, width - n:] = torch.randint(1, case["vocab"], (n,), generator=gen)
        mask[b, width - n:] = 1
    return ids.to(device), mask.to(device)


def run_generate(model, ids, mask, new: int, compiled: bool):
    import torch
    from transformers import CompileConfig

    extra = dict(cache_implementation="static", compile_config=CompileConfig(fullgraph=True)) if compiled else {}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              **extra)


def main() -> None:
    def extra(p):
        p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
        p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))

    args = common.parse_args(__doc__.splitlines()[0], extra)
    case = build_case(args)
    batch, new = len(case["prompts"]), case["new"]
    modes = [m for m in args.modes.split(",") if args.device == "cuda" or m == "eager"]  # compiles on GPUs only
    impls = args.impls.split(",")
    print(f"batch {batch}, prompts {case['prompts']}, {new} new tokens, modes {modes}")
    if args.dry_run:
        return
    import torch

    env = common.env_info(args.device)
    model = make_model(case, args.device)
    ids, mask = make_batch(case, args.device)
    rows, tokens = [], {}
    for mode in modes:
        # Every implementation is warmed up (compiled) first, then the timed calls alternate between
        # them round by round, so the host's drift over the run (the calls are host-bound) falls on
        # every implementation alike rather than on whichever ran last.
        live, mode_rows = [], []
        for impl in impls:
            model.set_attn_implementation(impl)
            row = dict(impl=impl, mode=mode, batch=batch, new_tokens=new, layers=case["layers"], times=[])
            try:
                start = time.perf_counter()
                run_generate(model, ids, mask, new, mode == "compiled")
                row["warmup_s"] = round(time.perf_counter() - start, 2)
                live.append(row)
            except Exception as err:  # a failing row is reported, the others still run
                row["note"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            mode_rows.append(row)
        for _ in range(1 if args.smoke else 3):
            for row in list(live):
                model.set_attn_implementation(row["impl"])
                try:
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = run_generate(model, ids, mask, new, mode == "compiled")
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    row["times"].append(time.perf_counter() - start)
                    tokens[row["impl"], mode] = out[:, ids.shape[1]:]
                except Exception as err:
                    row["note"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                    live.remove(row)
        for row in mode_rows:
            times = row.pop("times")
            if times and "note" not in row:
                row["tokens_per_s"] = round(batch * new / statistics.median(times), 1)
        rows += mode_rows
        common.write_csv(f"{args.out}/generate.csv", rows, env, quiet=True)
        torch._dynamo.reset()
    for row in rows:
        mine, ref = tokens.get((row["impl"], row["mode"])), tokens.get(("sdpa", row["mode"]))
        if mine is not None and ref is not None:
            row["same_tokens"] = f"{(mine == ref).float().mean().item():.0%}"
    common.write_csv(f"{args.out}/generate.csv", rows, env)
    common.print_env(env)
    common.print_table("generate() tokens/s", ["attention", "mode", "tokens/s", "warm-up s", "same tokens as sdpa", "note"],
                       [[r["impl"], r["mode"], common.fmt(r.get("tokens_per_s")), r.get("warmup_s", ""),
                         r.get("same_tokens", ""), r.get("note", "")] for r in rows])


if __name__ == "__main__":
    main()
