"""A GGUF's blocks of 32 (Q5_0, Q8_0) on their own kernels (Q50Matrix, Q80Matrix: the file's codes, 5.5 / 8.5 bits a
weight) against the int8 kernel over the same codes widened to int8 (Int8Matrix: 10 bits a weight), which ran them
before.

    python -m benchmarks.blocks_of_32 [--target qwen2.5-coder-0.5b] [--rows 1 4 8] [--reps 20] [--out DIR]

The decision it backs: docs/design/kquant-kernels.md ("Blocks of 32 on their own kernels"). Reads every Q5_0 and
Q8_0 matrix of the target's GGUF (the 0.5B's q, k, v, o, gate and up, and its 151,936-row head; the token embedding
is looked up, not multiplied), builds both forms of each, checks they give the same numbers bit for bit on the same
rows, then times one pass over all matrices of a kind (what they cost a forward of N rows; 318 MB of the 0.5B's file,
out of cache as in decoding), the forms interleaved rep by rep (medians). Needs AVX512-VNNI. Writes
DIR/blocks_of_32.json.
"""

from __future__ import annotations

import os

from benchmarks.harness import interleave, median_ms, parser, print_table, write_report

KINDS = ("Q5_0", "Q8_0")


def blocks_of_32(gguf_file) -> dict[str, list]:
    """Every Q5_0 and Q8_0 matrix of the file as KQuantBlocks [N, K], by kind, in file order (N a multiple of 32,
    which the int8 kernel needs)."""
    import gguf
    import torch

    from specdistill.models.kquant import KQuantBlocks

    found: dict[str, list] = {kind: [] for kind in KINDS}
    for tensor in gguf.GGUFReader(str(gguf_file)).tensors:
        kind = tensor.tensor_type.name
        if kind not in found or tensor.name == "token_embd.weight" or int(tensor.shape[1]) % 32:
            continue
        raw = torch.from_numpy(tensor.data.copy()).reshape(int(tensor.shape[1]), -1)  # [N, K/32 * block bytes]
        found[kind].append(KQuantBlocks(kind, raw))
    return {kind: blocks for kind, blocks in found.items() if blocks}


def widened(lib, blocks):
    """The int8 kernel's Int8Matrix over exactly `blocks`' codes and steps (how they ran before)."""
    from specdistill.models.kquant import int8_fields
    from specdistill.models.quant_formats import int8_layout

    f = int8_fields(blocks)
    n, k = blocks.shape
    w = int8_layout(f["codes"].reshape(n, k // 32, 32), f["d"])
    return lib.Int8Matrix(w.codes, w.step, w.bias)


def pass_over(matrices, rows: dict):
    """Every matrix once over x [R, K] of its K."""
    return [m.gemm(rows[m.K]) for m in matrices]


def parse_args(argv=None):
    p = parser(__doc__, "blocks_of_32", reps=20)
    p.add_argument("--target", default="qwen2.5-coder-0.5b", help="a named real target (models.real_targets)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    args = p.parse_args(argv)
    if any(not 1 <= r <= 64 for r in args.rows) or args.reps < 1:
        p.error("--rows between 1 and 64, --reps at least 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from specdistill.models import kernels
    from specdistill.models.kernel_linear import kquant_matrix
    from specdistill.models.real_targets import REAL_TARGETS, fetch_gguf

    if (why := kernels.kquant_unavailable()) is not None:
        raise SystemExit(f"blocks_of_32 needs the K-quant kernels (AVX512-VNNI or the AVX2 build): {why}")
    if args.target not in REAL_TARGETS:
        raise SystemExit(f"--target must be one of {sorted(REAL_TARGETS)}, got {args.target!r}")
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    lib = kernels.library()
    found = blocks_of_32(fetch_gguf(REAL_TARGETS[args.target]))
    if not found:
        raise SystemExit(f"{args.target}: its GGUF holds no Q5_0 or Q8_0 matrix")
    forms = {(kind, form): [kquant_matrix(lib, b) if form == "own" else widened(lib, b) for b in blocks]
             for kind, blocks in found.items() for form in ("own", "int8")}
    generator = torch.Generator().manual_seed(0)
    widths = {b.shape[1] for blocks in found.values() for b in blocks}
    inputs = {r: {k: torch.randn(r, k, generator=generator) for k in widths} for r in args.rows}
    same = {kind: all(torch.equal(a, b) for r in args.rows for a, b in
                      zip(pass_over(forms[kind, "own"], inputs[r]), pass_over(forms[kind, "int8"], inputs[r])))
            for kind in found}
    times = interleave({(kind, form, r): (lambda key=(kind, form), r=r: pass_over(forms[key], inputs[r]))
                        for (kind, form) in forms for r in args.rows}, args.reps, args.warmup)
    ms = median_ms(times)
    file_mb = {kind: sum(b.raw.numel() for b in blocks) / 1e6 for kind, blocks in found.items()}
    for kind in found:
        print(f"{kind}: {len(found[kind])} matrices of {args.target} ({file_mb[kind]:.0f} MB in the file), one pass "
              f"each, median of {args.reps}; the same numbers as the int8 kernel: {same[kind]}")
    print_table(["kind", "rows", "int8 kernel (widened), ms", "own kernel, ms", "speedup"],
                [[kind, r, ms[kind, "int8", r], ms[kind, "own", r], ms[kind, "int8", r] / ms[kind, "own", r]]
                 for kind in found for r in args.rows])
    results = {"target": args.target, "matrices": {k: len(v) for k, v in found.items()}, "file_mb": file_mb,
               "same_numbers": same,
               "ms": {kind: {form: {r: ms[kind, form, r] for r in args.rows} for form in ("own", "int8")}
                      for kind in found},
               "speedup": {kind: {r: ms[kind, "int8", r] / ms[kind, "own", r] for r in args.rows} for kind in found}}
    write_report(args.out, "blocks_of_32", results, args)
    return results


if __name__ == "__main__":
    main()
