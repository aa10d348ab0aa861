"""Decode-time attention by rows and context: the kernel taking a key/value head's query heads together (up to 3 a
pass over its keys, each key and value read once for them) against the same kernel taking one query head a pass
(`heads_together=1`, the kernel before 2026-12-06).

    python -m benchmarks.attention_heads [--heads 12 --kv-heads 2 --hd 128] [--rows 1 4 8 16]
        [--context 300 1000] [--layers 28] [--reps 100] [--out DIR]

The defaults are Qwen2.5-Coder-1.5B's attention (12 query heads over 2 key/value heads of 128); the embedded target is
`--heads 9 --kv-heads 3 --hd 64 --layers 30`. Rows see the whole prefix and a causal block of themselves, as a
verified chain does. Checks first that both ways give the same bits (each head's numbers are its own alone), then
times them interleaved rep by rep (medians), per layer and for `--layers` layers. Writes DIR/attention_heads.json.
"""

from __future__ import annotations

import os

from benchmarks.harness import interleave, median_ms, parser, print_table, write_report


def attention_inputs(heads: int, kv_heads: int, hd: int, rows: int, context: int):
    """q [H, N, hd], keys and values [Hkv, context + N, hd] and visible [N, context + N]: the prefix and a causal
    block of the rows."""
    import torch

    g = torch.Generator().manual_seed(rows * 7919 + context)
    width = context + rows
    q = torch.randn(heads, rows, hd, generator=g)
    keys, values = torch.randn(kv_heads, width, hd, generator=g), torch.randn(kv_heads, width, hd, generator=g)
    visible = torch.ones(rows, width, dtype=torch.bool)
    visible[:, context:] = torch.ones(rows, rows, dtype=torch.bool).tril()
    return q, keys, values, visible


def parse_args(argv=None):
    p = parser(__doc__, "attention_heads", reps=100)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--hd", type=int, default=128)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--context", type=int, nargs="+", default=[300, 1000])
    p.add_argument("--layers", type=int, default=28)
    args = p.parse_args(argv)
    if args.kv_heads < 1 or args.heads % args.kv_heads or args.hd % 16 or not 16 <= args.hd <= 256:
        p.error("--heads a multiple of --kv-heads, --hd a multiple of 16 up to 256")
    if min(args.rows) < 1 or min(args.context) < 1 or args.reps < 1 or args.layers < 1:
        p.error("--rows, --context, --reps and --layers at least 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from specdistill.models import kernels

    if (why := kernels.unavailable()) is not None:
        raise SystemExit(f"attention_heads needs the kernel library: {why}")
    lib = kernels.library()
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    scale = args.hd ** -0.5
    shapes = [(n, t) for t in args.context for n in args.rows]
    inputs = {s: attention_inputs(args.heads, args.kv_heads, args.hd, *s) for s in shapes}
    ways = {"together": lambda s: lib.attention_rows(*inputs[s], scale),  # up to 3 heads a pass (the default)
            "one head at a time": lambda s: lib.attention_rows(*inputs[s], scale, heads_together=1)}
    same = all(torch.equal(ways["together"](s), ways["one head at a time"](s)) for s in shapes)
    times = interleave({(w, s): (lambda w=w, s=s: ways[w](s)) for w in ways for s in shapes}, args.reps, args.warmup)
    ms = median_ms(times)
    print(f"attention of {args.heads} query heads over {args.kv_heads} key/value heads of {args.hd}, median of "
          f"{args.reps}; the same bits both ways: {same}")
    print_table(["context", "rows", "together, us a layer", "one at a time, us", "speedup",
                 f"together x{args.layers} layers, ms"],
                [[t, n, 1000 * ms["together", (n, t)], 1000 * ms["one head at a time", (n, t)],
                  ms["one head at a time", (n, t)] / ms["together", (n, t)], args.layers * ms["together", (n, t)]]
                 for n, t in shapes])
    results = {"same_bits": same, "us_a_layer": {w: {f"{n}x{t}": 1000 * ms[w, (n, t)] for n, t in shapes}
                                                 for w in ways}}
    write_report(args.out, "attention_heads", results, args)
    return results


if __name__ == "__main__":
    main()
