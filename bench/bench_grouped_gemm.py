"""grouped_gemm_fp8 on the GPU beside torch's built-ins, same run: µs, TFLOPS, GB/s, share of
the measured copy bandwidth; a table, a JSON file and a PNG.

    python bench/bench_grouped_gemm.py [--no-kernel] [--no-promotion] [--both-clusters] [--only SUBSTR] [--reps N]
                                       [--json PATH] [--png PATH]

Implementations (each row of the table):

* ``cute_moe``        ``cute_moe.kernels.grouped_gemm_sm90.grouped_gemm_fp8_cuda`` (1x128 A scales,
                      128x128 B scales), given align's expert counts on the decode shapes as fused_moe
                      does; left out with ``--no-kernel``.
* ``cute_moe_unscaled`` (``--no-promotion``) the same kernel, tiles and pipeline with the block scales
                      dropped (one accumulator, no promotion): what the promotion costs, measured.
* ``cute_moe_pairs_n`` / ``cute_moe_pairs_m`` (``--both-clusters``) the kernel with its cluster
                      direction forced (pairs of N tiles sharing A / of M tiles sharing B), to check
                      the shape heuristic ``cluster_along_m`` that ``cute_moe`` follows (with the
                      tile width ``wide_tile`` picks; ``ab_grouped_gemm.py --variant tile_n=128``
                      forces a width).
* ``cublas_block``    ``torch._scaled_mm`` with blockwise 1x128 / 128x128 f32 scales (cuBLAS), a *dense*
                      GEMM with the same FLOPs: M = all routed rows (decode: rounded up to 16),
                      one expert's N x K weight.  Convention (torch 2.9-2.11): ``scale_a`` [M, K/128]
                      column-major (strides (1, M)), ``scale_b`` the transposed [N/128, K/128] tensor
                      (shape [K/128, N/128], strides (1, K/128)).  A probe on a small non-square
                      problem checks the call *and its numerics* first; other layouts are tried if
                      that one is refused or wrong, and the row says 'unavailable' with the error if
                      none works — the bench never stops on a peer.
* ``scaled_grouped``  ``torch._scaled_grouped_mm`` with rowwise scales (per row of A, per column of
                      each B[e]), the same padded segments as cute_moe (``offs`` = expert_offsets[1:]).
* ``bf16_grouped``    ``torch._grouped_mm`` on bf16 copies of A and B, same segments.

Shapes (issue 3): DeepGEMM's contiguous set G=4 x M=8192 and G=8 x M=4096 per group, EP-style
G=32 x M=512, and DeepSeek-V3 decode routing (uniform random top-8 of 256 experts through
``align_ref``, segments padded to 128 rows) for T in {1, 16, 128, 1024}; each with
N x K in {4096 x 7168, 7168 x 2048}.  Beyond the issue: the same routing at T=4096 and 8192 ("routed"),
the GEMMs of a prefill MoE layer: ~128 / ~256 rows per expert, so every expert's weights serve
only 1-3 M tiles (the contiguous shapes reuse them over 4-64).

Counting: FLOPs = 2 * routed rows * N * K (padding rows excluded), for every implementation
(the dense peer: its own M).  Bytes = minimal HBM traffic: the routed rows' activations (codes +
scales), the *touched* experts' weights (codes + scales; bf16 for the bf16 peer) and the routed
rows' bf16 output (padding rows excluded, as in the FLOPs; before session 14 they were counted);
``w GB/s`` is the touched weights alone (the decode figure of merit, against the copy bandwidth
measured in the same run).  Time (``Timer.time_us``): median device time of a
CUDA-graph replay, L2 flushed (``Timer.graph_us``); event timing of eager calls
(``Timer.kernel_us``) for a peer that cannot be captured (the row's ``timing``: graph / eager).
Random data (routing included) is seeded by the shape's name: the same in every run and process.
"""
from __future__ import annotations

import argparse
import os
import sys
import zlib
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cute_moe.reference import align_ref, dequant_block_128x128_ref  # noqa: E402
from cute_moe.timing import Timer  # noqa: E402
from bench_io import add_output_args, png_path, pyplot, save_figure, write_json  # noqa: E402

BLOCK = 128
FP8 = torch.float8_e4m3fn
NK = ((4096, 7168), (7168, 2048))  # DeepSeek-V3: w13 (2I x H) and w2 (H x I)
DSV3_EXPERTS, DSV3_TOPK = 256, 8
DECODE_TOKENS = (1, 16, 128, 1024)
ROUTED_TOKENS = (4096, 8192)  # prefill through the same routing
IMPLS = ("cute_moe", "cute_moe_unscaled", "cute_moe_pairs_n", "cute_moe_pairs_m",
         "cublas_block", "scaled_grouped", "bf16_grouped")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int = BLOCK) -> int:
    return _cdiv(a, b) * b


# ----------------------------------------------------------------------------- shapes and inputs


@dataclass
class Shape:
    name: str
    kind: str  # contiguous | ep | decode | routed (decode's routing at prefill size)
    E: int
    N: int
    K: int
    rows_per_group: int = 0  # contiguous / ep
    tokens: int = 0  # decode, routed


def shapes() -> list[Shape]:
    out = []
    for N, K in NK:
        out += [Shape(f"G4xM8192 {N}x{K}", "contiguous", 4, N, K, rows_per_group=8192),
                Shape(f"G8xM4096 {N}x{K}", "contiguous", 8, N, K, rows_per_group=4096),
                Shape(f"G32xM512 {N}x{K}", "ep", 32, N, K, rows_per_group=512)]  # fmt: skip
        out += [Shape(f"decode T={t} {N}x{K}", "decode", DSV3_EXPERTS, N, K, tokens=t) for t in DECODE_TOKENS]
        out += [Shape(f"routed T={t} {N}x{K}", "routed", DSV3_EXPERTS, N, K, tokens=t) for t in ROUTED_TOKENS]
    return out


def seed_from(name: str) -> None:
    """Seed torch's CPU and CUDA generators from ``name``, so that a shape's (or a model's) random
    data, its routing included, is the same in every run and process: A/Bs across processes and
    sessions then compare the same problem (bench_moe's T=128 row once moved by 14% between runs
    with its routing)."""
    torch.manual_seed(zlib.crc32(name.encode()))


def _rand_fp8(*shape: int) -> torch.Tensor:
    """Random e4m3 codes, generated in chunks along dim 0 (E=256 x 4096 x 7168 would need 30 GB of f32)."""
    out = torch.empty(*shape, dtype=FP8, device="cuda")
    per = max(1, (1 << 28) // max(1, out[0].numel())) if shape[0] else 1
    for i in range(0, shape[0], per):
        out[i : i + per] = torch.randn(out[i : i + per].shape, device="cuda").to(FP8)
    return out


def _rand_scales(*shape: int, scale: float) -> torch.Tensor:
    return torch.empty(*shape, device="cuda").uniform_(0.5, 1.5) * scale


@dataclass
class Problem:
    shape: Shape
    offsets: torch.Tensor  # int32 [E + 1]
    counts: list[int]
    m_cap: int
    a: torch.Tensor  # fp8 [M_cap, K]
    a_scale: torch.Tensor  # f32 [M_cap, K/128], strides (1, M_cap)
    b: torch.Tensor  # fp8 [E, N, K]
    b_scale: torch.Tensor  # f32 [E, ceil(N/128), K/128]
    expert_counts: torch.Tensor | None  # int32 [E], decode routings (align's counts), as fused_moe passes them

    @property
    def end(self) -> int:
        return int(self.offsets[-1])

    @property
    def routed_rows(self) -> int:
        return sum(self.counts)

    @property
    def touched(self) -> int:
        return sum(1 for c in self.counts if c)


def make_problem(s: Shape) -> Problem:
    seed_from(s.name)
    if s.kind in ("decode", "routed"):
        ids = torch.rand(s.tokens, s.E, device="cuda").argsort(dim=1)[:, :DSV3_TOPK].to(torch.int32)
        offsets, row_to_token, _, counts_t = align_ref(ids, s.E, BLOCK)
        counts, m_cap = counts_t.tolist(), row_to_token.shape[0]
        expert_counts = counts_t.to(torch.int32)
    else:
        counts = [s.rows_per_group] * s.E
        offsets = torch.tensor([0] + [s.rows_per_group * (e + 1) for e in range(s.E)], dtype=torch.int32, device="cuda")
        m_cap = s.rows_per_group * s.E
        expert_counts = None
    kb = s.K // BLOCK
    a = _rand_fp8(m_cap, s.K)
    a_scale = _rand_scales(kb, m_cap, scale=1e-2).t()  # MN-major, as permute_quant writes it
    b = _rand_fp8(s.E, s.N, s.K)
    b_scale = _rand_scales(s.E, _cdiv(s.N, BLOCK), kb, scale=1e-4)
    return Problem(s, offsets, counts, m_cap, a, a_scale, b, b_scale, expert_counts)


# ----------------------------------------------------------------------------- probes (never raise)


def _dequant_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """f32 [R, K] from codes and per-row 1x128 scales [R, K/128]."""
    return q.float() * s.float().repeat_interleave(BLOCK, dim=1)


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


# (label, make(scale_a_rowmajor [M, K/128], scale_b_blocks [N/128, K/128]) -> (scale_a, scale_b))
SCALED_MM_LAYOUTS = (
    ("scale_a (1, M)-strided [M, K/128]; scale_b = [N/128, K/128].t()",
     lambda sa, sb: (sa.t().contiguous().t(), sb.contiguous().t())),
    ("scale_a (1, M)-strided [M, K/128]; scale_b contiguous [K/128, N/128]",
     lambda sa, sb: (sa.t().contiguous().t(), sb.t().contiguous())),
    ("scale_a contiguous [M, K/128]; scale_b = [N/128, K/128].t()",
     lambda sa, sb: (sa.contiguous(), sb.contiguous().t())),
)  # fmt: skip


def probe_scaled_mm_blockwise():
    """(layout index or None, message): which blockwise calling convention this torch accepts *and*
    computes correctly, on M x N x K = 256 x 384 x 512 (N/128 = 3 != K/128 = 4, so a transposed
    scale tensor cannot pass by accident; K/128 a multiple of 4, like the bench's 56 and 16, because
    some torch versions want the 128x128 scales' row stride padded to a multiple of 4)."""
    if not hasattr(torch, "_scaled_mm"):
        return None, "torch._scaled_mm does not exist in this torch"
    M, N, K = 256, 384, 512
    a, b = _rand_fp8(M, K), _rand_fp8(N, K)
    sa, sb = _rand_scales(M, K // BLOCK, scale=1.0), _rand_scales(N // BLOCK, K // BLOCK, scale=1.0)
    want = _dequant_rows(a, sa) @ dequant_block_128x128_ref(b, sb).t()
    errors = []
    for i, (label, make) in enumerate(SCALED_MM_LAYOUTS):
        try:
            scale_a, scale_b = make(sa, sb)
            got = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 (a probe: report, never crash)
            errors.append(f"[{label}] {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            continue
        err = _rel_l2(got, want)
        if err <= 1e-2:
            return i, f"ok with {label} (probe rel L2 {err:.1e})"
        errors.append(f"[{label}] accepted but wrong: rel L2 {err:.2e}")
    return None, "unavailable: " + " | ".join(errors)


def probe_scaled_grouped_mm():
    """(ok, message): rowwise torch._scaled_grouped_mm on 2D A x 3D B with an empty group."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False, "unavailable: torch._scaled_grouped_mm does not exist in this torch"
    G, N, K, counts = 3, 256, 512, (128, 0, 256)
    M = sum(counts)
    a, b = _rand_fp8(M, K), _rand_fp8(G, N, K)
    sa, sb = _rand_scales(M, scale=1.0), _rand_scales(G, N, scale=1.0)
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    try:
        got = torch._scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs=ends, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        return False, f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    lo, worst = 0, 0.0
    for g, c in enumerate(counts):
        if c:
            want = (a[lo : lo + c].float() * sa[lo : lo + c, None]) @ (b[g].float() * sb[g, :, None]).t()
            worst = max(worst, _rel_l2(got[lo : lo + c], want))
        lo += c
    return (True, f"ok (probe rel L2 {worst:.1e})") if worst <= 1e-2 else (False, f"unavailable: wrong result, rel L2 {worst:.2e}")


def probe_grouped_mm():
    if not hasattr(torch, "_grouped_mm"):
        return False, "unavailable: torch._grouped_mm does not exist in this torch"
    G, N, K, counts = 3, 256, 512, (128, 0, 256)
    a = torch.randn(sum(counts), K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    try:
        got = torch._grouped_mm(a, b.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        return False, f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    want = torch.cat([a[:128].float() @ b[0].float().t(), a[128:].float() @ b[2].float().t()])
    err = _rel_l2(got, want)
    return (True, f"ok (probe rel L2 {err:.1e})") if err <= 1e-2 else (False, f"unavailable: wrong result, rel L2 {err:.2e}")


# ----------------------------------------------------------------------------- one row per (shape, impl)


def _spot_check(c: torch.Tensor, p: Problem) -> float:
    """Relative L2 error of up to 128 rows of up to 3 non-empty experts against dequantized f32."""
    offs, worst = p.offsets.tolist(), 0.0
    experts = [e for e, n in enumerate(p.counts) if n][:3]
    for e in experts:
        lo, n = offs[e], min(p.counts[e], BLOCK)
        b_e = dequant_block_128x128_ref(p.b[e], p.b_scale[e])
        want = _dequant_rows(p.a[lo : lo + n], p.a_scale[lo : lo + n]) @ b_e.t()
        worst = max(worst, _rel_l2(c[lo : lo + n], want))
    return worst


def bench_shape(timer: Timer, p: Problem, impls: dict, scaled_mm_layout, reps: int) -> list[dict]:
    s = p.shape
    N, K, kb = s.N, s.K, s.K // BLOCK
    flops = 2 * p.routed_rows * N * K
    act_bytes = p.routed_rows * (K + 4 * kb)
    w_fp8 = p.touched * (N * K + 4 * _cdiv(N, BLOCK) * kb)
    out_bytes = p.routed_rows * N * 2
    rows = []

    def row(impl, us, how, flops_, w_bytes, bytes_, note=""):
        r = {"shape": s.name, "kind": s.kind, "E": s.E, "N": N, "K": K, "tokens": s.tokens,
             "rows_per_group": s.rows_per_group, "routed_rows": p.routed_rows, "m_cap": p.m_cap, "end": p.end,
             "touched_experts": p.touched, "impl": impl, "timing": how, "us": us, "flops": flops_,
             "weight_bytes": w_bytes, "bytes": bytes_, "note": note}  # fmt: skip
        if us is not None:
            r.update(tflops=flops_ / us / 1e6, gbs=bytes_ / us / 1e3, weight_gbs=w_bytes / us / 1e3)
        rows.append(r)

    if "cute_moe" in impls:
        fn = impls["cute_moe"]
        args = (p.a, p.a_scale, p.b, p.b_scale, p.offsets, p.expert_counts)
        note = f"spot-check rel L2 {_spot_check(fn(*args), p):.1e}"
        us, how = timer.time_us(lambda: fn(*args), reps)
        row("cute_moe", us, how, flops, w_fp8, act_bytes + w_fp8 + out_bytes, note)

    if "cute_moe_unscaled" in impls:
        fn = impls["cute_moe_unscaled"]
        args = (p.a, p.a_scale, p.b, p.b_scale, p.offsets)
        us, how = timer.time_us(lambda: fn(*args), reps)
        row("cute_moe_unscaled", us, how, flops, w_fp8, act_bytes + w_fp8 + out_bytes, "no scale promotion")

    for impl in ("cute_moe_pairs_n", "cute_moe_pairs_m"):
        if impl in impls:
            args = (p.a, p.a_scale, p.b, p.b_scale, p.offsets, p.expert_counts)
            us, how = timer.time_us(lambda: impls[impl](*args), reps)
            row(impl, us, how, flops, w_fp8, act_bytes + w_fp8 + out_bytes, "cluster direction forced")

    if "cublas_block" in impls:
        if scaled_mm_layout is None:
            row("cublas_block", None, None, 0, 0, 0, impls["cublas_block"])
        else:
            m = max(16, _round_up(p.routed_rows, 16))
            a_d = p.a[:m] if m <= p.m_cap else _rand_fp8(m, K)
            sa_d = _rand_scales(m, kb, scale=1e-2)
            scale_a, scale_b = SCALED_MM_LAYOUTS[scaled_mm_layout][1](sa_d, p.b_scale[0])
            b_t = p.b[0].t()
            try:
                us, how = timer.time_us(lambda: torch._scaled_mm(a_d, b_t, scale_a=scale_a, scale_b=scale_b,
                                                                 out_dtype=torch.bfloat16), reps)  # fmt: skip
                w_bytes = N * K + 4 * _cdiv(N, BLOCK) * kb
                row("cublas_block", us, how, 2 * m * N * K, w_bytes, m * (K + 4 * kb) + w_bytes + m * N * 2,
                    f"dense M={m}, one expert's weight")
            except Exception as exc:  # noqa: BLE001 (a peer never stops the bench)
                row("cublas_block", None, None, 0, 0, 0, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

    ends = p.offsets[1:]
    if "scaled_grouped" in impls:
        if impls["scaled_grouped"] is not True:
            row("scaled_grouped", None, None, 0, 0, 0, impls["scaled_grouped"])
        else:
            sa_r = _rand_scales(p.m_cap, scale=1e-2)
            sb_r = _rand_scales(s.E, N, scale=1e-4)
            b_t = p.b.transpose(-2, -1)
            try:
                us, how = timer.time_us(lambda: torch._scaled_grouped_mm(p.a, b_t, sa_r, sb_r, offs=ends,
                                                                        out_dtype=torch.bfloat16), reps)  # fmt: skip
                w_bytes = p.touched * (N * K + 4 * N)
                row("scaled_grouped", us, how, flops, w_bytes, p.routed_rows * (K + 4) + w_bytes + out_bytes,
                    "rowwise scales")
            except Exception as exc:  # noqa: BLE001
                row("scaled_grouped", None, None, 0, 0, 0, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            del sa_r, sb_r, b_t

    if "bf16_grouped" in impls:
        if impls["bf16_grouped"] is not True:
            row("bf16_grouped", None, None, 0, 0, 0, impls["bf16_grouped"])
        else:
            try:
                a16 = p.a.to(torch.bfloat16)
                b16 = p.b.to(torch.bfloat16)
                b16_t = b16.transpose(-2, -1)
                gemm = lambda: torch._grouped_mm(a16, b16_t, offs=ends, out_dtype=torch.bfloat16)  # noqa: E731
                us, how = timer.time_us(gemm, reps)
                w_bytes = p.touched * N * K * 2
                row("bf16_grouped", us, how, flops, w_bytes, p.routed_rows * K * 2 + w_bytes + out_bytes)
                del a16, b16, b16_t
            except Exception as exc:  # noqa: BLE001 (e.g. out of memory for bf16 copies of 256 experts)
                row("bf16_grouped", None, None, 0, 0, 0, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return rows


# ----------------------------------------------------------------------------- output


def print_table(rows: list[dict], copy_gbs: float) -> None:
    cublas = {r["shape"]: r.get("tflops") for r in rows if r["impl"] == "cublas_block"}
    print(f"{'shape':>26} {'impl':>17} {'us':>9} {'TFLOPS':>8} {'GB/s':>7} {'w GB/s':>7} {'%copy':>6} "
          f"{'x cuBLAS':>8}  note")  # fmt: skip
    for r in rows:
        if r["us"] is None:
            print(f"{r['shape']:>26} {r['impl']:>17} {'—':>9}  {r['note'][:100]}")  # full text: probes, JSON
            continue
        ref = cublas.get(r["shape"])
        vs = f"{r['tflops'] / ref:8.2f}" if ref else f"{'':>8}"
        print(f"{r['shape']:>26} {r['impl']:>17} {r['us']:>9.1f} {r['tflops']:>8.0f} {r['gbs']:>7.0f} "
              f"{r['weight_gbs']:>7.0f} {100 * r['gbs'] / copy_gbs:>6.1f} {vs}  {r['note']}")  # fmt: skip


def plot(rows: list[dict], copy_gbs: float, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    impls = [i for i in IMPLS if any(r["impl"] == i and r["us"] is not None for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(16, 6))
    for ax, kinds, key, ylabel in ((axes[0], ("contiguous", "ep", "routed"), "tflops", "TFLOPS"),
                                   (axes[1], ("decode",), "weight_gbs", "expert-weight GB/s")):  # fmt: skip
        names = list(dict.fromkeys(r["shape"] for r in rows if r["kind"] in kinds))
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            vals = {r["shape"]: r.get(key) or 0 for r in rows if r["impl"] == impl}
            ax.bar([i + j * width for i in range(len(names))], [vals.get(n, 0) for n in names], width, label=impl)
        if key == "weight_gbs":
            ax.axhline(copy_gbs, color="k", linestyle="--", linewidth=1, label=f"copy {copy_gbs:.0f} GB/s")
        ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    save_figure(fig, f"grouped FP8 GEMM, {torch.cuda.get_device_name()}", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_args(parser, "bench_grouped_gemm.json")
    parser.add_argument("--no-kernel", action="store_true", help="bench only the torch peers (no cute_moe kernel)")
    parser.add_argument("--no-promotion", action="store_true",
                        help="also run cute_moe's kernel with the block scales dropped (same tiles)")
    parser.add_argument("--both-clusters", action="store_true",
                        help="also run cute_moe's kernel with either cluster direction forced")
    parser.add_argument("--only", default=None, help="only shapes whose name contains this substring")
    parser.add_argument("--reps", type=int, default=100)
    args = parser.parse_args()
    png = png_path(args)

    timer = Timer()
    copy_gbs = timer.copy_bandwidth_gbs()
    impls: dict = {}
    if not args.no_kernel:
        try:
            from cute_moe.kernels.grouped_gemm_sm90 import grouped_gemm_fp8_cuda  # noqa: PLC0415
        except ImportError as exc:
            sys.exit(f"cute_moe's grouped GEMM kernel is not importable ({exc}); run with --no-kernel for the peers")
        impls["cute_moe"] = grouped_gemm_fp8_cuda
        if args.no_promotion:
            impls["cute_moe_unscaled"] = lambda *a: grouped_gemm_fp8_cuda(*a, block_scaled=False)
        if args.both_clusters:
            impls["cute_moe_pairs_n"] = lambda *a: grouped_gemm_fp8_cuda(*a, along_m=False)
            impls["cute_moe_pairs_m"] = lambda *a: grouped_gemm_fp8_cuda(*a, along_m=True)
    layout, msg_mm = probe_scaled_mm_blockwise()
    impls["cublas_block"] = msg_mm
    ok_sg, msg_sg = probe_scaled_grouped_mm()
    impls["scaled_grouped"] = True if ok_sg else msg_sg
    ok_g, msg_g = probe_grouped_mm()
    impls["bf16_grouped"] = True if ok_g else msg_g
    probes = {"torch._scaled_mm blockwise": msg_mm, "torch._scaled_grouped_mm rowwise": msg_sg,
              "torch._grouped_mm bf16": msg_g}  # fmt: skip
    print(f"device: {torch.cuda.get_device_name()}   torch {torch.__version__}   "
          f"copy bandwidth (read+write): {copy_gbs:.0f} GB/s")  # fmt: skip
    for k, v in probes.items():
        print(f"probe {k}: {v}")

    rows = []
    for s in shapes():
        if args.only and args.only not in s.name:
            continue
        p = make_problem(s)
        rows += bench_shape(timer, p, impls, layout, args.reps)
        del p
        torch.cuda.empty_cache()

    print_table(rows, copy_gbs)
    write_json(args.json, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "copy_gbs": copy_gbs, "probes": probes, "rows": rows})  # fmt: skip
    print(f"json: {args.json}")
    plot(rows, copy_gbs, png)


if __name__ == "__main__":
    main()
