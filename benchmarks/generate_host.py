"""Host cost of one generate() decoding step's attention with attn_implementation="tileattn", on a CPU.

Issue #17: ``benchmarks/generate.py --quick`` in eager mode is host-bound on the H200, and
tileattn's per-step host time is what separates it from SDPA. This times that part alone, with
``host_launch.py``'s stand-in driver and kernels (Triton's launch path runs, the kernels do
nothing; the Triton backend, value checks on the device, as on a GPU), the split rule as on the
H200 (132 SMs; ``--splits cpu``: this CPU's rule, 1 split).

The step is what transformers' eager generate() makes of generate.py's quick case (hidden 1024,
2 layers, 16 query heads over 4 KV heads, hdim 64, bf16, a batch of 8 prompts of 96 to 512
tokens left padded to 512, DynamicCache): ``create_causal_mask`` calls the registered mask
function ``tileattn_mask`` with the step's fresh bool mask (one column more than the last step's),
then each layer calls ``tileattn_attention_forward`` with q (8, 16, 1, 64) and the layer's
keys and values (8, 4, seen + 1, 64), fresh contiguous tensors each step (DynamicCache's
``torch.cat``), the arguments as Qwen2's attention passes them. The tensors of ``--steps``
consecutive steps are made before timing (their making is transformers' cost, not tileattn's);
the timed loop runs the steps in order, ``--sweeps`` times per repeat. Prints the median µs
per step over ``--repeat`` repeats, and per step how many ``DecodePlan``s were made anew (not
carried on from the last step), how many launch plans (``FwdPlan``) the steps made with the plan
caches emptied first, and how many plan runs there were (one per layer: the decoding route).

The steps repeat every sweep, so after the first a launch plan keyed by a step's cache length is
found in the cache; a real generate() sees each length once. ``--fresh-plans`` empties the
launch plans' cache before every sweep, so that a step whose launch plan depends on its length
makes one as it would in generate() (a plan that does not is made once per sweep: 1 in
``--steps``).

    python benchmarks/generate_host.py [--steps 32] [--sweeps 20] [--repeat 7] [--clock cpu] [--fresh-plans]
                                       [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import host_launch as H
import torch

import tileattn.gpu.attention as A
import tileattn.integrations.transformers as tt

PROMPTS = (512, 96, 384, 200, 448, 128, 320, 256)  # generate.py's batch, left padded to the longest
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 16, 4, 64
H200_LIMITS = (132, 232448)  # multiprocessors, shared memory one block may use


class _Attention(torch.nn.Module):
    """What tileattn reads of transformers' attention module: ``is_causal``."""

    is_causal = True


def h200_splits() -> None:
    """The split rule as on the H200 (the CPU's gives 1): its SM count and shared memory."""
    auto = A._auto_splits
    A._gpu_limits = lambda index: H200_LIMITS
    A._auto_splits = lambda programs, blocks, device, *args, **kw: auto(programs, blocks, torch.device("cuda", 0),
                                                                          *args, **kw)


def make_steps(n_steps: int) -> list:
    """Per step: (the mask function's keywords, per layer (q, k, v, the layer's other keywords))."""
    dt, batch, width = torch.bfloat16, len(PROMPTS), max(PROMPTS)
    pad = torch.tensor([width - n for n in PROMPTS])
    steps = []
    for t in range(n_steps):
        seen = width + t  # tokens in the cache before this step's one
        ids_mask = (torch.arange(seen + 1)[None] >= pad[:, None]).long()  # generate()'s int mask
        mask = ids_mask.to(torch.bool)  # _preprocess_mask_arguments: a fresh bool tensor each step
        position_ids = (ids_mask.sum(1, keepdim=True) - 1)
        mask_kwargs = dict(batch_size=batch, q_length=1, kv_length=seen + 1, q_offset=seen, kv_offset=0,
                           mask_function=None, attention_mask=mask, allow_is_causal_skip=True, dtype=dt, config=None,
                           use_vmap=False, device=torch.device("cpu"))
        layers = []
        for _ in range(LAYERS):
            q = torch.empty(batch, HEADS, 1, HEAD_DIM, dtype=dt)  # rotary's fresh output
            k, v = (torch.empty(batch, KV_HEADS, seen + 1, HEAD_DIM, dtype=dt) for _ in "kv")  # torch.cat's
            layers.append((q, k, v, dict(dropout=0.0, scaling=HEAD_DIM**-0.5, sliding_window=None,
                                         position_ids=position_ids, use_cache=True)))
        steps.append((mask_kwargs, layers))
    return steps


def run_steps(steps, module, fresh_plans: bool = False) -> None:
    if fresh_plans:
        A._PLANS.clear()
    for mask_kwargs, layers in steps:
        mask = tt.tileattn_mask(**mask_kwargs)
        for q, k, v, kwargs in layers:
            tt.tileattn_attention_forward(module, q, k, v, mask, **kwargs)


def count_plans(steps, module) -> tuple[float, float, float]:
    """(DecodePlans made anew, FwdPlans made, plan runs) per step over one run of the steps, the
    launch plans' cache emptied first: every layer should run a plan (the decoding route, no
    packing)."""
    from tileattn.ops.decode_plan import DecodePlan

    counts, made, fwd_made = [0, 0, 0], DecodePlan.__init__, A.FwdPlan.__init__
    runs = {name: getattr(DecodePlan, name) for name in ("run", "_run_fitted") if hasattr(DecodePlan, name)}

    def counted_init(*args, **kwargs):
        counts[0] += 1
        made(*args, **kwargs)

    def counted_fwd(*args, **kwargs):
        counts[1] += 1
        fwd_made(*args, **kwargs)

    def counted(run):
        def counted_run(*args, **kwargs):
            counts[2] += 1
            return run(*args, **kwargs)
        return counted_run

    DecodePlan.__init__, A.FwdPlan.__init__ = counted_init, counted_fwd
    for name, run in runs.items():
        setattr(DecodePlan, name, counted(run))
    try:
        run_steps(steps, module, fresh_plans=True)
    finally:
        DecodePlan.__init__, A.FwdPlan.__init__ = made, fwd_made
        for name, run in runs.items():
            setattr(DecodePlan, name, run)
    return tuple(n / len(steps) for n in counts)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--sweeps", type=int, default=20, help="runs of the steps per repeat")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--splits", choices=("h200", "cpu"), default="h200")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--glibc-default", action="store_true", help="leave glibc's trimming and mmap as they are")
    p.add_argument("--fresh-plans", action="store_true",
                   help="empty the launch plans' cache before every sweep (each length new, as in generate())")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the timed steps instead")
    args = p.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if not args.glibc_default:
        H.keep_freed_memory()
    H.stand_in_launches()
    H.as_on_a_gpu()
    if args.splits == "h200":
        h200_splits()
    steps, module = make_steps(args.steps), _Attention()
    with torch.no_grad():  # generate() decodes under no_grad
        run_steps(steps, module)  # warm: the kernels' stand-ins made, plans kept
        made, fwd_made, runs = count_plans(steps, module)
        run_steps(steps, module)  # the launch plans back in the cache
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.sweeps):
                run_steps(steps, module, args.fresh_plans)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
            return
        times = []
        for _ in range(args.repeat):
            t0 = clock()
            for _ in range(args.sweeps):
                run_steps(steps, module, args.fresh_plans)
            times.append((clock() - t0) / (args.sweeps * len(steps)) * 1e6)
    fresh = ", launch plans made afresh each sweep" if args.fresh_plans else ""
    print(f"generate() decoding step's attention ({LAYERS} layers, batch {len(PROMPTS)}, splits as {args.splits}): "
          f"{statistics.median(times):.1f} µs per step, median of {args.repeat} "
          f"(min {min(times):.1f}, max {max(times):.1f}){fresh}; "
          f"per step: {made:.2f} DecodePlans made anew, {fwd_made:.2f} FwdPlans made (cache emptied first), "
          f"{runs:g} plan runs")


if __name__ == "__main__":
    main()
