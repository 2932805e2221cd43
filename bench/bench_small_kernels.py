"""Every small kernel of the MoE layer on the GPU in one run (issue 5's benchmark): route, align,
permute_quant, permute (FP8 in), silu_mul_quant, finalize and moe_reduce at DeepSeek-V3's and
Qwen3-235B's shapes: µs, GB/s and share of the copy bandwidth measured in the same run, beside the
plain-PyTorch composition of the same step (cute_moe.reference on CUDA tensors); a table, a JSON
file and a PNG.

    python bench/bench_small_kernels.py [--only OP[,OP]] [--model SUBSTR] [--tokens 1,16,128]
                                        [--budget-s 480] [--json PATH] [--png PATH]

Shapes: ``DeepSeek-V3`` (H=7168, I=2048, E=256, top-8; route: deepseek_v3 with score bias, groups
8/4, scaling 2.5) and ``Qwen3-235B`` (H=4096, I=1536, E=128, top-8; route: renormalize), T in
{1, 16, 128, 1024, 4096, 16384}.  ``--only`` keeps the ops whose name contains one of its
comma-separated substrings (``--only finalize,moe_reduce``), ``--model`` the models whose name
contains it; ``--budget-s`` skips the (model, T) points left once the wall time passes it, and
says so.  The whole run should take 2-3 minutes on an H200 (an estimate: ~1 s to compile each of
~20 kernel variants, then at most ~0.5 s per row, the plain compositions at T=16384 the longest;
not yet run).

Rows (ops):

* ``route``, ``align``: bench_route.py's cases (align on route's ids).
* ``permute_quant[rows]`` (row_to_token only: the row-major kernel, one gather and quantization
  per routed row), ``permute_quant[tokens]`` (token_to_row given too: the token-major kernel,
  each token row read and quantized once) and ``permute_quant[tok,nopad]`` (the token-major
  kernel with ``zero_padding=False``, as fused_moe calls it: the padding rows left unwritten).
* ``permute``: the FP8-in variant, x's codes and 1x128 scales (quant_fp8 of x) gathered as they are.
* ``silu_mul_quant`` (expert_offsets only: every row of every segment, padding included) and
  ``silu_mul_quant[counts]`` (align's expert_counts given, as fused_moe calls it: the padding rows
  are neither read nor written), on h [M_cap, 2I] bf16.
* ``finalize``, ``moe_reduce[f32 acc]``, ``moe_reduce[bf16 acc]``: bench_finalize.py's cases.

Routing: route and align run on route's own ids; the other rows on uniform random top-k ids
through align_ref (``%pad``: the share of the segments' rows that are padding under it).  Each
(model, T) and each set of inputs is seeded by its name: every run, whatever ``--only`` keeps,
times the same problem.

Time: ``us`` is the median device time of one CUDA-graph replay after an L2 flush
(``Timer.graph_us``), for every row; GB/s and %copy come from it.  ``amort. us`` is the per-call
time of 100 back-to-back calls in one CUDA graph (``Timer.graph_amortized_us``; inputs that fit
stay in L2): for route and align at every T (issue 5's route target is on this figure) and for
the other ops at T <= 16, where one cold replay's few-µs floor hides the kernel.  ``torch us``:
the plain composition, a CUDA-graph replay where it can be captured, else eager calls between
events (``Timer.time_us``: a composition that syncs with the host, as align_ref does, is timed
eagerly without a capture being tried; a capture that a sync invalidates can leave torch 2.11's
allocator unusable for the rest of the process), median of 20.  A call that fails leaves its cells
empty and says why in the row's note; the bench goes on, and the JSON is rewritten after each
(model, T).  ``CUTE_MOE_DEBUG`` is unset for the run (its checks sync the host).

Bytes counted minimally (read + written by the op's semantics; padding rows not counted):

* route, align: bench_route.py's counts (logits and bias in, ids and weights out; ids in, the
  four maps out);
* permute_quant: x read once (T·H·2), the routed rows' codes and scales written (both kernels;
  the padding rows both zero are not counted: about 10% more bytes at T=16384, most of them
  below);
* permute: x's codes and scales read once, the routed rows' written;
* silu_mul_quant: the routed rows of h (2I bf16) read, their codes and scales written (both ways:
  without counts the kernel also moves the padding rows, about 11% more bytes at T=16384 and
  nearly all of them at decode sizes);
* finalize, moe_reduce: bench_finalize.py's counts.

The header also gives the write-only bandwidth of the same GPU (a fill kernel, ~78% of the copy
figure on an H200).  It is not a bound for permute_quant, which writes about four bytes for each
one it reads: its bulk copies write faster than the fill, and a plain contiguous stream of its byte
mix reaches 88-91% of copy (bench/NOTES.md, session 14).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, NamedTuple, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cute_moe  # noqa: E402
from cute_moe.reference import permute_quant_ref, permute_ref, silu_mul_quant_ref  # noqa: E402
from cute_moe.timing import Timer  # noqa: E402
from bench_finalize import finalize_case, moe_reduce_cases, random_routing  # noqa: E402
from bench_grouped_gemm import seed_from  # noqa: E402
from bench_io import add_output_args, parse_tokens, png_path, pyplot, save_figure, write_json  # noqa: E402
from bench_moe import _fmt_exc  # noqa: E402
from bench_route import MODELS as ROUTING, TOKENS, route_align_cases  # noqa: E402

MODELS = {  # bench_route's routing of each model, with its hidden and expert intermediate sizes
    "DeepSeek-V3": {**ROUTING["DeepSeek-V3"], "H": 7168, "I": 2048},
    "Qwen3-235B": {**ROUTING["Qwen3-235B"], "H": 4096, "I": 1536},
}
AMORTIZED_OPS = ("route", "align")  # timed back to back in a graph at every T
AMORTIZED_MAX_T = 16  # ... and every other op up to this T (decode)
PLAIN_REPS = 20  # the plain compositions take up to ~20 ms each at T=16384


class Case(NamedTuple):
    nbytes: int  # counted minimally
    ours: Callable
    plain: Callable  # the plain-PyTorch composition of the same step
    padding_pct: Optional[float] = None  # for the rows whose kernels may move the padding rows


# ----------------------------------------------------------------------------- bytes


def permute_quant_bytes(t: int, h: int, routed_rows: int) -> int:
    """x [T, H] bf16 read once; the routed rows' FP8 codes and f32 1x128 scales written."""
    return t * h * 2 + routed_rows * (h + h // 128 * 4)


def permute_bytes(t: int, h: int, routed_rows: int) -> int:
    """x's FP8 codes and f32 1x128 scales read once; the routed rows' written."""
    return (t + routed_rows) * (h + h // 128 * 4)


def silu_mul_quant_bytes(routed_rows: int, inter: int) -> int:
    """The routed rows of h [M_cap, 2I] bf16 read; their FP8 codes and f32 1x128 scales written."""
    return routed_rows * (2 * inter * 2 + inter + inter // 128 * 4)


def padding_pct(routing) -> float:
    offsets, _, _, counts = routing
    return 100 * (1 - int(counts.sum()) / max(int(offsets[-1]), 1))


# ----------------------------------------------------------------------------- the cases of one (model, T)


def _route_step(m: dict, t: int, routing) -> dict:
    return {op: Case(*case) for op, case in route_align_cases(m, t, routing[0].device).items()}


def _gather_step(m: dict, t: int, routing) -> dict:
    offsets, r2t, t2r, counts = routing
    x = torch.randn(t, m["H"], device=offsets.device, dtype=torch.bfloat16)
    codes, scales = cute_moe.quant_fp8(x)
    routed, pad = int(counts.sum()), padding_pct(routing)
    nbytes = permute_quant_bytes(t, m["H"], routed)
    plain = lambda: permute_quant_ref(x, r2t, offsets)  # noqa: E731  (its result does not depend on token_to_row)
    return {
        "permute_quant[rows]": Case(nbytes, lambda: cute_moe.permute_quant(x, r2t, offsets), plain, pad),
        "permute_quant[tokens]": Case(nbytes, lambda: cute_moe.permute_quant(x, r2t, offsets, token_to_row=t2r),
                                      plain, pad),
        "permute_quant[tok,nopad]": Case(nbytes, lambda: cute_moe.permute_quant(x, r2t, offsets, token_to_row=t2r,
                                                                                zero_padding=False), plain, pad),
        "permute": Case(permute_bytes(t, m["H"], routed), lambda: cute_moe.permute(codes, scales, r2t, offsets),
                        lambda: permute_ref(codes, scales, r2t, offsets), pad),
    }  # fmt: skip


def _silu_step(m: dict, t: int, routing) -> dict:
    offsets, r2t, _, counts = routing
    h = torch.randn(r2t.shape[0], 2 * m["I"], device=offsets.device, dtype=torch.bfloat16)
    nbytes, pad = silu_mul_quant_bytes(int(counts.sum()), m["I"]), padding_pct(routing)
    plain = lambda: silu_mul_quant_ref(h, offsets)  # noqa: E731
    return {
        "silu_mul_quant": Case(nbytes, lambda: cute_moe.silu_mul_quant(h, offsets), plain, pad),
        "silu_mul_quant[counts]": Case(nbytes, lambda: cute_moe.silu_mul_quant(h, offsets, expert_counts=counts),
                                       plain, pad),
    }  # fmt: skip


def _finalize_step(m: dict, t: int, routing) -> dict:
    return {"finalize": Case(*finalize_case(routing, m["H"]))}


def _reduce_step(m: dict, t: int, routing) -> dict:
    cases = moe_reduce_cases(t, m["k"], m["H"], routing[0].device)
    return {f"moe_reduce[{'f32' if acc else 'bf16'} acc]": Case(*case) for acc, case in cases.items()}


STEPS = (  # (the rows one set of inputs serves, its builder: (model, T, routing) -> {op: Case})
    (("route", "align"), _route_step),
    (("permute_quant[rows]", "permute_quant[tokens]", "permute_quant[tok,nopad]", "permute"), _gather_step),
    (("silu_mul_quant", "silu_mul_quant[counts]"), _silu_step),
    (("finalize",), _finalize_step),
    (("moe_reduce[f32 acc]", "moe_reduce[bf16 acc]"), _reduce_step),
)
OPS = tuple(op for ops, _ in STEPS for op in ops)


def select(names, only: Optional[str]) -> list[str]:
    """The names that contain one of ``only``'s comma-separated substrings (case-insensitive); all of
    them without ``only``."""
    if not only:
        return list(names)
    wanted = [w.strip().lower() for w in only.split(",") if w.strip()]
    return [n for n in names if any(w in n.lower() for w in wanted)]


# ----------------------------------------------------------------------------- timing


def _attempt(measure: Callable):
    """(measure(), None), or (None, what failed): one failing call never stops the bench."""
    try:
        return measure(), None
    except Exception as exc:  # noqa: BLE001
        if torch.cuda.is_initialized():  # (not in the CPU tests' dry run)
            torch.cuda.synchronize()
        return None, _fmt_exc(exc)


def time_case(timer, model: str, t: int, op: str, case: Case, copy_gbs: float) -> dict:
    """One row: the kernel's µs (one cold replay, and back to back in a graph where listed), its GB/s
    and % of copy, the plain composition's µs."""
    m = MODELS[model]
    us, failed = _attempt(lambda: timer.graph_us(case.ours))
    notes = [failed]
    amortized = None
    if us is not None and (op in AMORTIZED_OPS or t <= AMORTIZED_MAX_T):
        amortized, failed = _attempt(lambda: timer.graph_amortized_us(case.ours))
        notes.append(failed and f"amortized: {failed}")
    plain, failed = _attempt(lambda: timer.time_us(case.plain, PLAIN_REPS))
    notes.append(failed and f"torch: {failed}")
    torch_us, torch_timing = plain or (None, None)
    row = {"model": model, "H": m["H"], "E": m["E"], "k": m["k"], "op": op, "T": t, "bytes": case.nbytes,
           "us": us, "amortized_us": amortized, "torch_us": torch_us, "torch_timing": torch_timing,
           "padding_pct": case.padding_pct, "note": "; ".join(n for n in notes if n)}  # fmt: skip
    if us is not None:
        row.update(gbs=case.nbytes / us / 1e3, pct_copy=100 * case.nbytes / us / 1e3 / copy_gbs)
    return row


def bench_point(timer, model: str, t: int, ops: list[str], copy_gbs: float, device: str = "cuda") -> list[dict]:
    """The rows of ``ops`` at one (model, T), a set of inputs at a time (each freed before the next)."""
    m = MODELS[model]
    seed_from(f"{model} T={t}")
    routing = random_routing(t, m["E"], m["k"], device)
    rows = []
    for step_ops, build in STEPS:
        wanted = [op for op in step_ops if op in ops]
        if not wanted:
            continue
        seed_from(f"{model} T={t} {step_ops[0]}")
        cases, failed = _attempt(lambda: build(m, t, routing))
        if cases is None:
            rows += [{"model": model, "op": op, "T": t, "us": None, "note": failed} for op in wanted]
            continue
        rows += [time_case(timer, model, t, op, cases[op], copy_gbs) for op in wanted]
        del cases
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- output


def _cell(v, spec: str) -> str:
    """``v`` formatted by ``spec`` (width first), or blanks of that width for a missing value."""
    width = int(spec.split(".")[0])
    return format(v, spec) if v is not None else " " * width


def print_table(rows: list[dict]) -> None:
    print(f"{'model':>12} {'op':>24} {'T':>6} {'us':>8} {'GB/s':>7} {'%copy':>6} {'amort. us':>9} {'torch us':>9} "
          f"{'speedup':>7} {'%pad':>5}  note")  # fmt: skip
    for r in rows:
        if r["us"] is None:
            print(f"{r['model']:>12} {r['op']:>24} {r['T']:>6} {'—':>8}  {r['note'][:110]}")
            continue
        speedup = r["torch_us"] / r["us"] if r["torch_us"] is not None else None
        print(f"{r['model']:>12} {r['op']:>24} {r['T']:>6} {r['us']:>8.2f} {r['gbs']:>7.0f} {r['pct_copy']:>6.1f} "
              f"{_cell(r['amortized_us'], '9.2f')} {_cell(r['torch_us'], '9.1f')} {_cell(speedup, '7.1f')} "
              f"{_cell(r['padding_pct'], '5.1f')}  {r['note']}")  # fmt: skip


def plot(rows: list[dict], path: str, device: str) -> None:
    """Per model: % of copy against T (top) and µs against T (bottom, plain PyTorch dashed), an op a line."""
    plt = pyplot()
    if plt is None:
        return
    timed = [r for r in rows if r["us"] is not None]
    models = list(dict.fromkeys(r["model"] for r in timed))
    if not models:
        print("nothing timed: no plot written")
        return
    fig, axes = plt.subplots(2, len(models), figsize=(8 * len(models), 10), squeeze=False)
    for col, model in enumerate(models):
        top, bottom = axes[0][col], axes[1][col]
        mine = [r for r in timed if r["model"] == model]
        for i, op in enumerate(OPS):
            pts = sorted((r["T"], r["pct_copy"], r["us"]) for r in mine if r["op"] == op)
            if not pts:
                continue
            style = dict(color=f"C{i % 10}", marker="os^"[i // 10])  # the same per op in every panel
            top.plot([p[0] for p in pts], [p[1] for p in pts], label=op, **style)
            bottom.plot([p[0] for p in pts], [p[2] for p in pts], **style)
            peer = sorted((r["T"], r["torch_us"]) for r in mine if r["op"] == op and r["torch_us"] is not None)
            if peer:
                bottom.plot(*zip(*peer), linestyle="--", **style)
        top.axhline(100, color="k", linestyle=":", linewidth=1)
        top.set_ylabel("% of copy bandwidth (bytes counted minimally)")
        top.legend(fontsize=7)
        bottom.set_ylabel("µs (one replay, L2 flushed; dashed: plain PyTorch)")
        bottom.set_yscale("log")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens T")
            ax.grid(True, which="both", alpha=0.3)
        top.set_title(f"{model} (H={MODELS[model]['H']}, E={MODELS[model]['E']}, top-{MODELS[model]['k']})")
    save_figure(fig, f"small MoE kernels, {device}", path)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="ops: " + ", ".join(OPS))  # fmt: skip
    add_output_args(parser, "bench_small_kernels.json")
    parser.add_argument("--only", default=None, help="only ops whose name contains one of these comma-separated "
                        "substrings (case-insensitive)")  # fmt: skip
    parser.add_argument("--model", default=None, help="only models whose name contains this substring "
                        f"(case-insensitive): {', '.join(MODELS)}")  # fmt: skip
    parser.add_argument("--tokens", default=None,
                        help=f"comma-separated T values (default {','.join(map(str, TOKENS))})")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-time budget; later (model, T) are skipped")
    args = parser.parse_args(argv)
    png = png_path(args)
    ops, models = select(OPS, args.only), select(MODELS, args.model)
    if not ops:
        raise SystemExit(f"--only {args.only!r} matches no op ({', '.join(OPS)})")
    if not models:
        raise SystemExit(f"--model {args.model!r} matches no model ({', '.join(MODELS)})")
    tokens = parse_tokens(args.tokens, TOKENS)
    if not torch.cuda.is_available():
        raise SystemExit("bench_small_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    if os.environ.pop("CUTE_MOE_DEBUG", None) is not None:  # its checks sync the host: nothing could be captured
        print("bench_small_kernels: CUTE_MOE_DEBUG unset for this run (its index checks sync the host)")

    t0 = time.monotonic()
    timer = Timer()
    copy_gbs = timer.copy_bandwidth_gbs()
    write_gbs = timer.write_bandwidth_gbs()
    device = torch.cuda.get_device_name()
    rows: list[dict] = []
    for model in models:
        for t in tokens:
            if time.monotonic() - t0 > args.budget_s:
                rows += [{"model": model, "op": op, "T": t, "us": None, "note": "skipped: --budget-s spent"}
                         for op in ops]  # fmt: skip
                continue
            rows += bench_point(timer, model, t, ops, copy_gbs)
            print(f"  {model} T={t}: done at {time.monotonic() - t0:.0f} s", flush=True)
            # Written as it goes: a failure at a later point keeps the rows measured before it.
            write_json(args.json, {"device": device, "torch": torch.__version__, "copy_gbs": copy_gbs,
                                   "write_gbs": write_gbs, "rows": rows})  # fmt: skip
    print(f"device: {device}   torch {torch.__version__}   copy bandwidth (read+write): {copy_gbs:.0f} GB/s   "
          f"write-only (fill): {write_gbs:.0f} GB/s = {100 * write_gbs / copy_gbs:.1f}% of copy")
    print_table(rows)
    write_json(args.json, {"device": device, "torch": torch.__version__, "copy_gbs": copy_gbs,
                           "write_gbs": write_gbs, "rows": rows})  # fmt: skip
    print(f"json: {args.json}")
    plot(rows, png, device)


if __name__ == "__main__":
    main()
