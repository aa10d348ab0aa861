"""A GGUF's Q5_0 matrices on their own kernel (Q50Matrix: the file's 5-bit codes, 5.5 bits a weight) against the
int8 kernel over the same codes widened to int8 (Int8Matrix: 10 bits a weight), which ran them before.

    python -m benchmarks.q5_0_gemm [--target qwen2.5-coder-0.5b] [--rows 1 4 8] [--reps 20] [--out DIR]

The decision it backs: docs/design/kquant-kernels.md ("Q5_0 on its own kernel"). Reads every Q5_0 matrix of the
target's GGUF (the 0.5B's q, k, o, gate and up: 173 MB of its 24 layers, out of cache as in decoding), builds both
forms of each, checks they give the same numbers bit for bit on the same rows, then times one pass over all of them
(what those matrices cost a forward of N rows), the two forms interleaved rep by rep (medians). Needs AVX512-VNNI.
Writes DIR/q5_0_gemm.json.
"""

from __future__ import annotations

import os

from benchmarks.harness import interleave, median_ms, parser, print_table, write_report


def q5_0_blocks(gguf_file) -> list:
    """Every Q5_0 tensor of the file as KQuantBlocks [N, K], in file order."""
    import gguf
    import torch

    from specdistill.models.kquant import KQuantBlocks

    reader = gguf.GGUFReader(str(gguf_file))
    blocks = []
    for tensor in reader.tensors:
        if tensor.tensor_type.name != "Q5_0" or tensor.name == "token_embd.weight":  # the embedding is looked up
            continue
        raw = torch.from_numpy(tensor.data.copy()).reshape(int(tensor.shape[1]), -1)  # [N, K/32 * 22]
        blocks.append(KQuantBlocks("Q5_0", raw))
    return blocks


def both_forms(lib, blocks) -> dict[str, list]:
    """{"q5_0": Q50Matrix each, "int8": Int8Matrix each over the same codes} (the int8 kernel needs N % 32)."""
    from specdistill.models.kernel_linear import kquant_matrix
    from specdistill.models.kquant import int8_fields
    from specdistill.models.quant_formats import int8_layout

    def widened(b):
        f = int8_fields(b)
        n, k = b.shape
        w = int8_layout(f["codes"].reshape(n, k // 32, 32), f["d"])
        return lib.Int8Matrix(w.codes, w.step, w.bias)
    usable = [b for b in blocks if b.shape[0] % 32 == 0]
    return {"q5_0": [kquant_matrix(lib, b) for b in usable], "int8": [widened(b) for b in usable]}


def pass_over(matrices, rows: dict):
    """Every matrix once over x [R, K] of its K."""
    return [m.gemm(rows[m.K]) for m in matrices]


def parse_args(argv=None):
    p = parser(__doc__, "q5_0_gemm", reps=20)
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
    from specdistill.models.real_targets import REAL_TARGETS, fetch_gguf

    if (why := kernels.vnni_unavailable()) is not None:
        raise SystemExit(f"q5_0_gemm needs the kernel library on AVX512-VNNI: {why}")
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    lib = kernels.library()
    if args.target not in REAL_TARGETS:
        raise SystemExit(f"--target must be one of {sorted(REAL_TARGETS)}, got {args.target!r}")
    blocks = q5_0_blocks(fetch_gguf(REAL_TARGETS[args.target]))
    if not blocks:
        raise SystemExit(f"{args.target}: its GGUF holds no Q5_0 matrix")
    forms = both_forms(lib, blocks)
    widths = {b.shape[1] for b in blocks}
    generator = torch.Generator().manual_seed(0)
    inputs = {r: {k: torch.randn(r, k, generator=generator) for k in widths} for r in args.rows}
    same = all(torch.equal(a, b) for r in args.rows
               for a, b in zip(pass_over(forms["q5_0"], inputs[r]), pass_over(forms["int8"], inputs[r])))
    times = interleave({(f, r): (lambda f=f, r=r: pass_over(forms[f], inputs[r])) for f in forms for r in args.rows},
                       args.reps, args.warmup)
    ms = median_ms(times)
    native_mb = sum(b.raw.numel() for b in blocks if b.shape[0] % 32 == 0) / 1e6
    print(f"{len(forms['q5_0'])} Q5_0 matrices of {args.target} ({native_mb:.0f} MB in the file), one pass each, "
          f"median of {args.reps}; the forms give the same numbers: {same}")
    print_table(["rows", "int8 (widened), ms", "q5_0, ms", "speedup"],
                [[r, ms["int8", r], ms["q5_0", r], ms["int8", r] / ms["q5_0", r]] for r in args.rows])
    results = {"target": args.target, "matrices": len(forms["q5_0"]), "file_mb": native_mb, "same_numbers": same,
               "ms": {f: {r: ms[f, r] for r in args.rows} for f in forms},
               "speedup": {r: ms["int8", r] / ms["q5_0", r] for r in args.rows}}
    write_report(args.out, "q5_0_gemm", results, args)
    return results


if __name__ == "__main__":
    main()
