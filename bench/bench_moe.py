"""The whole MoE layer on the GPU: cute_moe.FusedMoE beside plain-PyTorch compositions, same run:
µs per layer, TFLOPS, GB/s of the touched expert weights; a table, a JSON file and a PNG
(latency vs T per model, and a roofline).

    python bench/bench_moe.py [--only SUBSTR] [--tokens 1,64,4096] [--budget-s 480] [--reps N]
                              [--json PATH] [--png PATH]

Models (routed experts only; shared experts and the router GEMM are not timed, the router's
logits are an input):

* ``DeepSeek-V3``      E=256, H=7168, I=2048, top-8, deepseek_v3 routing (groups 8/4, bias, x2.5)
* ``DeepSeek-V3 EP8``  the same layer on one of 8 expert-parallel ranks: experts [0, 32) of 256
                       (global routing; only the token slots routed to local experts are computed)
* ``Qwen3-235B-A22B``  E=128, H=4096, I=1536, top-8, renormalize
* ``Qwen3-30B-A3B``    E=128, H=2048, I=768, top-8, renormalize
* ``Mixtral-8x7B``     E=8, H=4096, I=14336, top-2, renormalize

for T in {1, 8, 64, 256, 1024, 4096, 16384} tokens (``--tokens`` restricts, ``--only`` filters models).

Implementations (rows):

* ``cute_moe``        ``cute_moe.FusedMoE`` (route -> align -> permute_quant -> FP8 grouped GEMM ->
                      silu_mul_quant -> FP8 grouped GEMM -> finalize, 1x128 activation and 128x128
                      weight scales). Probed first on a small layer: while a step has no CUDA kernel
                      the row says 'unavailable' with the op's NotImplementedError.
* ``torch_fp8_rowwise`` plain PyTorch: HF-style routing (``torch.topk``), argsort permutation,
                      per-row FP8 activation quant, ``torch._scaled_grouped_mm`` with rowwise scales
                      (the block weights re-quantized per output row), SwiGLU, a second
                      ``_scaled_grouped_mm``, weighted un-permute in f32.
* ``torch_bf16``      the same composition with bf16 activations and ``torch._grouped_mm`` on bf16
                      copies of the dequantized weights.

Each torch peer is probed first (call *and* numerics, on ragged groups), which also picks the
smallest row alignment of its groups that it accepts (1, 16 or 128; padding rows are zero); a
peer that fails is reported, never stops the bench. All implementations compute the same layer
(the peers' weights derive from cute_moe's FP8 block weights); each row's note gives its relative
L2 distance from the bf16 peer (expected ~4%: the two FP8 activation quantizations).

Counting: FLOPs = 6 * (token slots routed to local experts) * H * I (two GEMMs, 2I*H and H*I per
slot; padding rows excluded). Weight bytes = the *touched* local experts' weights (FP8 codes +
scales; bf16 for the bf16 peer): ``w GB/s`` is the decode figure of merit, compared with the
device-to-device copy bandwidth measured in the same run. The roofline's bytes = touched weights +
x read + out written (the minimum traffic of a fully fused layer). Time: median device time of a
CUDA-graph replay, L2 flushed; event timing of eager calls when capture fails (``Timer.time_us``).
Weights (and DeepSeek-V3's score bias) are seeded by the model's name and each T's inputs by T:
every run routes the same tokens to the same experts.  ``--budget-s`` bounds the wall time: the
remaining (model, T) pairs are skipped, and say so.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
if os.path.dirname(_HERE) not in sys.path:  # a checkout without pip install -e
    sys.path.insert(1, os.path.dirname(_HERE))
from bench_grouped_gemm import _rand_fp8, _rand_scales, _rel_l2, seed_from  # noqa: E402
from bench_io import add_output_args, parse_tokens, png_path, pyplot, save_figure, write_json  # noqa: E402
from cute_moe.reference import dequant_block_128x128_ref  # noqa: E402

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
IMPLS = ("cute_moe", "torch_fp8_rowwise", "torch_bf16")
# H200 / H100 SXM spec sheet, dense (no sparsity): the roofline's compute ceilings
PEAK_TFLOPS = {"fp8": 1979.0, "bf16": 989.0}


@dataclass(frozen=True)
class Model:
    name: str
    E: int  # global experts
    H: int
    I: int
    top_k: int
    routing: str
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    expert_offset: int = 0
    local: Optional[int] = None  # local experts (expert parallelism); None = all

    @property
    def e_local(self) -> int:
        return self.E if self.local is None else self.local


_DSV3 = dict(E=256, H=7168, I=2048, top_k=8, routing="deepseek_v3", n_group=8, topk_group=4, scaling=2.5)
MODELS = (
    Model("DeepSeek-V3", **_DSV3),
    Model("DeepSeek-V3 EP8", **_DSV3, local=32),
    Model("Qwen3-235B-A22B", E=128, H=4096, I=1536, top_k=8, routing="renormalize"),
    Model("Qwen3-30B-A3B", E=128, H=2048, I=768, top_k=8, routing="renormalize"),
    Model("Mixtral-8x7B", E=8, H=4096, I=14336, top_k=2, routing="renormalize"),
)


# ----------------------------------------------------------------------------- weights


@dataclass
class Weights:
    w13: torch.Tensor  # fp8 [E_local, 2I, H], gate rows first
    s13: torch.Tensor  # f32 [E_local, 2I/128, H/128]
    w2: torch.Tensor  # fp8 [E_local, H, I]
    s2: torch.Tensor  # f32 [E_local, H/128, I/128]
    bias: Optional[torch.Tensor]  # f32 [E] (deepseek_v3)
    rw13: Optional[torch.Tensor] = None  # fp8 rowwise re-quantization, and its scales [E_local, 2I]
    rs13: Optional[torch.Tensor] = None
    rw2: Optional[torch.Tensor] = None
    rs2: Optional[torch.Tensor] = None
    b13: Optional[torch.Tensor] = None  # bf16 dequantized
    b2: Optional[torch.Tensor] = None


def make_weights(m: Model, rowwise: bool, bf16: bool) -> Weights:
    """Random FP8 block weights (values ~ N(0, 1/K)), and the peers' copies of the same weights."""
    El, H, I = m.e_local, m.H, m.I
    w13, w2 = _rand_fp8(El, 2 * I, H), _rand_fp8(El, H, I)
    s13 = _rand_scales(El, 2 * I // BLOCK, H // BLOCK, scale=H**-0.5)
    s2 = _rand_scales(El, H // BLOCK, I // BLOCK, scale=I**-0.5)
    bias = 0.1 * torch.randn(m.E, device="cuda") if m.routing == "deepseek_v3" else None
    w = Weights(w13, s13, w2, s2, bias)
    if rowwise:
        w.rw13, w.rs13 = torch.empty_like(w13), torch.empty(El, 2 * I, device="cuda")
        w.rw2, w.rs2 = torch.empty_like(w2), torch.empty(El, H, device="cuda")
    if bf16:
        w.b13 = torch.empty(El, 2 * I, H, dtype=torch.bfloat16, device="cuda")
        w.b2 = torch.empty(El, H, I, dtype=torch.bfloat16, device="cuda")
    for e in range(El if (rowwise or bf16) else 0):
        for q, s, rq, rs, b in ((w13, s13, w.rw13, w.rs13, w.b13), (w2, s2, w.rw2, w.rs2, w.b2)):
            f = dequant_block_128x128_ref(q[e], s[e])
            if rowwise:
                scale = f.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
                rq[e] = (f / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
                rs[e] = scale
            if bf16:
                b[e] = f.to(torch.bfloat16)
            del f
    return w


# ----------------------------------------------------------------------------- the plain-PyTorch composition


def torch_route(logits: torch.Tensor, m: Model, bias: Optional[torch.Tensor]):
    """HF-style routing with torch.topk: (ids int64 [T, k], weights f32 [T, k])."""
    logits = logits.float()
    if m.routing == "deepseek_v3":
        T = logits.shape[0]
        s = logits.sigmoid()
        c = s + bias
        g = c.view(T, m.n_group, m.E // m.n_group).topk(2, dim=-1)[0].sum(-1)
        gidx = g.topk(m.topk_group, dim=-1)[1]
        keep = torch.zeros_like(g).scatter_(1, gidx, 1.0).bool()
        keep = keep.unsqueeze(-1).expand(T, m.n_group, m.E // m.n_group).reshape(T, m.E)
        ids = c.masked_fill(~keep, float("-inf")).topk(m.top_k, dim=-1)[1]
        w = s.gather(1, ids)
        return ids, w / w.sum(-1, keepdim=True) * m.scaling
    vals, ids = logits.topk(m.top_k, dim=-1)  # renormalize: softmax over the top-k logits
    return ids, torch.softmax(vals, dim=-1) * m.scaling


def _quant_rows(x: torch.Tensor):
    """Per-row FP8: (codes, f32 scales [rows])."""
    scale = x.abs().amax(dim=1).float().clamp_min(1e-12) / FP8_MAX
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _gemm_fn(kind: str):
    """(a_rows [M, K], w [E, N, K], weight scales [E, N] or None, ends int32 [E]) -> bf16 [M, N]."""
    if kind == "torch_fp8_rowwise":

        def gemm(a, w, ws, ends):
            q, s = _quant_rows(a)
            return torch._scaled_grouped_mm(q, w.transpose(-2, -1), s, ws, offs=ends, out_dtype=torch.bfloat16)

    else:

        def gemm(a, w, ws, ends):
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16)

    return gemm


def torch_moe(x, logits, m: Model, w13, ws13, w2, ws2, bias, gemm, align: int) -> torch.Tensor:
    """The plain-PyTorch layer: route, group the token slots by local expert (argsort; each group
    padded to ``align`` rows), two grouped GEMMs around SwiGLU, weighted un-permute in f32.
    No host synchronisation (CUDA-graph capturable); every shape is static."""
    T, H = x.shape
    k, El = m.top_k, m.e_local
    ids, w = torch_route(logits, m, bias)
    flat = ids.reshape(-1) - m.expert_offset
    local = (flat >= 0) & (flat < El)
    key = torch.where(local, flat, El)  # El = "not local", sorted last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(El + 1, dtype=torch.int64, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    n = T * k
    sorted_key = key[order]
    if align == 1:
        rows_cap = n
        row_of_sorted = torch.arange(n, device=x.device)
        ends = counts[:El].cumsum(0).to(torch.int32)
    else:
        padded = (counts[:El] + align - 1) // align * align
        starts = padded.cumsum(0) - padded
        ends = (starts + padded).to(torch.int32)
        rank = torch.arange(n, device=x.device) - (counts.cumsum(0) - counts)[sorted_key]
        rows_cap = (n + min(n, El) * (align - 1) + align - 1) // align * align
        row_of_sorted = starts.index_select(0, sorted_key.clamp_max(El - 1)) + rank
    # slots not routed to a local expert go to a dump row past the end (zeros in, zeros out)
    row_of_sorted = torch.where(sorted_key < El, row_of_sorted, rows_cap)
    a = x.new_zeros(rows_cap + 1, H)
    a[row_of_sorted] = x[order // k]
    a = a[:rows_cap]
    h = gemm(a, w13, ws13, ends)
    inter = h.shape[1] // 2
    act = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(torch.bfloat16)
    y = gemm(act, w2, ws2, ends)
    row_of_pair = torch.empty_like(row_of_sorted).scatter_(0, order, row_of_sorted)  # [T*k]
    yz = torch.cat([y, y.new_zeros(1, H)])
    contrib = yz[row_of_pair].view(T, k, H).float()
    wl = torch.where(local.view(T, k), w, 0.0)
    return (contrib * wl[..., None]).sum(1).to(torch.bfloat16)


# ----------------------------------------------------------------------------- probes (never raise)


def _small_model() -> Model:
    return Model("probe", E=8, H=256, I=256, top_k=2, routing="renormalize")


def probe_cute_moe():
    """(layer factory or None, message)."""
    try:
        import cute_moe  # noqa: PLC0415
        from cute_moe import FusedMoE  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        return None, f"unavailable: import cute_moe failed: {type(exc).__name__}: {exc}"
    m = _small_model()
    w = make_weights(m, rowwise=False, bf16=False)
    layer = FusedMoE.from_fp8(w.w13, w.s13, w.w2, w.s2, top_k=m.top_k, routing_method=m.routing)
    x = torch.randn(37, m.H, device="cuda").bfloat16()
    logits = torch.randn(37, m.E, device="cuda")
    try:
        got = layer(x, logits)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        return None, f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    from cute_moe.reference import fused_moe_ref  # noqa: PLC0415

    ref = fused_moe_ref(x, logits, w.w13, w.s13, w.w2, w.s2, m.top_k, m.routing)  # the reference, on the GPU
    err = _rel_l2(got, ref)
    note = f"vs reference rel L2 {err:.1e}"
    if err > 1e-2:
        return None, f"unavailable: wrong result ({note})"
    return FusedMoE, f"ok (cute_moe {cute_moe.__version__}, probe {note})"


def probe_torch_peer(kind: str):
    """(row alignment or None, message): the smallest group alignment (1, 16, 128) at which the peer's
    grouped GEMMs run and agree with an f32 computation, on a small ragged layer with an empty expert."""
    fn_name = "_scaled_grouped_mm" if kind == "torch_fp8_rowwise" else "_grouped_mm"
    if not hasattr(torch, fn_name):
        return None, f"unavailable: torch.{fn_name} does not exist in this torch"
    m = _small_model()
    w = make_weights(m, rowwise=kind == "torch_fp8_rowwise", bf16=True)
    T = 37
    x = torch.randn(T, m.H, device="cuda").bfloat16()
    logits = torch.randn(T, m.E, device="cuda")
    logits[:, 3] = -1e4  # expert 3 gets no token
    ids, wts = torch_route(logits, m, None)
    # f32 dense layer on the dequantized weights
    xf = x.float()
    want = torch.zeros(T, m.H, device="cuda")
    for e in range(m.E):
        sel = (ids == e).any(dim=1)
        if sel.any():
            h = xf[sel] @ w.b13[e].float().t()
            a = torch.nn.functional.silu(h[:, : m.I]) * h[:, m.I :]
            coef = (wts * (ids == e)).sum(1)[sel]
            want[sel] += coef[:, None] * (a @ w.b2[e].float().t())
    gemm = _gemm_fn(kind)
    args = (w.rw13, w.rs13, w.rw2, w.rs2) if kind == "torch_fp8_rowwise" else (w.b13, None, w.b2, None)
    errors = []
    for align in (1, 16, 128):
        try:
            got = torch_moe(x, logits, m, *args, None, gemm, align)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"[align {align}] {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        err = _rel_l2(got, want)
        if err <= 8e-2:  # FP8 rowwise activations: a few %; bf16: < 1%
            return align, f"ok with groups aligned to {align} rows (probe rel L2 {err:.1e})"
        errors.append(f"[align {align}] wrong result: rel L2 {err:.2e}")
    return None, "unavailable: " + " | ".join(errors)


# ----------------------------------------------------------------------------- one (model, T)


def _fmt_exc(exc: BaseException) -> str:
    return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def layer_inputs(m: Model, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x bf16 [T, H], router logits f32 [T, E]), seeded by T."""
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, m.H, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(T, m.E, device="cuda", generator=gen)
    return x, logits


def cute_moe_layer(fused_moe_cls, m: Model, w: Weights):
    """``fused_moe_cls`` (``cute_moe.FusedMoE``) holding the model's weights and routing."""
    return fused_moe_cls.from_fp8(
        w.w13, w.s13, w.w2, w.s2, top_k=m.top_k, num_experts=m.E, routing_method=m.routing, n_group=m.n_group,
        topk_group=m.topk_group, routed_scaling_factor=m.scaling, score_bias=w.bias, expert_offset=m.expert_offset,
    )  # fmt: skip


def bench_point(timer, m: Model, w: Weights, T: int, impls: dict, reps: int) -> list[dict]:
    H, I, El = m.H, m.I, m.e_local
    x, logits = layer_inputs(m, T)
    ids, _ = torch_route(logits, m, w.bias)
    local_ids = ids[(ids >= m.expert_offset) & (ids < m.expert_offset + El)]
    slots = int(local_ids.numel())
    touched = int(torch.unique(local_ids).numel())
    flops = 6 * slots * H * I
    act_bytes = 2 * T * H * 2  # x read + out written, bf16
    w_fp8 = touched * (3 * H * I + 4 * (2 * I // BLOCK * H // BLOCK + H // BLOCK * I // BLOCK))
    w_rowwise = touched * (3 * H * I + 4 * (2 * I + H))
    w_bf16 = touched * 3 * H * I * 2
    rows: list[dict] = []
    outs: dict[str, torch.Tensor] = {}

    def row(impl: str, us, how, w_bytes: int, note: str) -> None:
        r = {"model": m.name, "E": m.E, "E_local": El, "H": H, "I": I, "top_k": m.top_k, "T": T,
             "local_slots": slots, "touched_experts": touched, "impl": impl, "timing": how, "us": us,
             "flops": flops, "weight_bytes": w_bytes, "bytes": w_bytes + act_bytes, "note": note}  # fmt: skip
        if us is not None:
            r.update(tflops=flops / us / 1e6, weight_gbs=w_bytes / us / 1e3, gbs=(w_bytes + act_bytes) / us / 1e3)
        rows.append(r)

    def run(impl: str, fn: Callable[[], torch.Tensor], w_bytes: int) -> None:
        state = impls[impl]
        if isinstance(state, str):
            row(impl, None, None, w_bytes, state)
            return
        try:
            outs[impl] = fn().float()
            us, how = timer.time_us(fn, reps)
            # an expert-parallel slice that got no routed rows still runs every launch
            row(impl, us, how, w_bytes, "" if slots else "no routed rows on this slice: launches only")
        except Exception as exc:  # noqa: BLE001 (a failing implementation never stops the bench)
            torch.cuda.synchronize()
            row(impl, None, None, w_bytes, _fmt_exc(exc))

    if "cute_moe" in impls:
        layer = None if isinstance(impls["cute_moe"], str) else cute_moe_layer(impls["cute_moe"], m, w)
        run("cute_moe", lambda: layer(x, logits), w_fp8)
    if "torch_fp8_rowwise" in impls:
        align = impls["torch_fp8_rowwise"]
        g = _gemm_fn("torch_fp8_rowwise")
        run("torch_fp8_rowwise",
            lambda: torch_moe(x, logits, m, w.rw13, w.rs13, w.rw2, w.rs2, w.bias, g, align), w_rowwise)  # fmt: skip
    if "torch_bf16" in impls:
        align = impls["torch_bf16"]
        g = _gemm_fn("torch_bf16")
        run("torch_bf16", lambda: torch_moe(x, logits, m, w.b13, None, w.b2, None, w.bias, g, align), w_bf16)
    base = outs.get("torch_bf16")
    for r in rows:
        if base is not None and r["impl"] in outs and r["impl"] != "torch_bf16" and base.norm() > 0:
            r["note"] = (r["note"] + " " if r["note"] else "") + f"vs bf16 rel L2 {_rel_l2(outs[r['impl']], base):.1e}"
    return rows


# ----------------------------------------------------------------------------- output


def print_table(rows: list[dict], copy_gbs: float) -> None:
    peer = {(r["model"], r["T"]): r["us"] for r in rows if r["impl"] == "torch_fp8_rowwise" and r["us"]}
    print(f"{'model':>16} {'T':>6} {'impl':>18} {'us':>10} {'TFLOPS':>7} {'w GB/s':>7} {'%copy':>6} "
          f"{'x fp8 peer':>10}  note")  # fmt: skip
    for r in rows:
        if r["us"] is None:
            print(f"{r['model']:>16} {r['T']:>6} {r['impl']:>18} {'—':>10}  {r['note'][:110]}")
            continue
        ref = peer.get((r["model"], r["T"]))
        vs = f"{ref / r['us']:10.2f}" if ref else f"{'':>10}"
        print(f"{r['model']:>16} {r['T']:>6} {r['impl']:>18} {r['us']:>10.1f} {r['tflops']:>7.1f} "
              f"{r['weight_gbs']:>7.0f} {100 * r['weight_gbs'] / copy_gbs:>6.1f} {vs}  {r['note']}")  # fmt: skip


def plot(rows: list[dict], copy_gbs: float, path: str, device: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    timed = [r for r in rows if r["us"] is not None]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not timed or not models:
        print("nothing timed: no plot written")
        return
    ncols = len(models) + 1
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 4.8))
    markers = dict(zip(IMPLS, "os^"))
    for ax, name in zip(axes[:-1], models):
        for impl in IMPLS:
            pts = sorted((r["T"], r["us"]) for r in timed if r["model"] == name and r["impl"] == impl)
            if pts:
                ax.plot(*zip(*pts), marker=markers[impl], label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("µs per layer")
        ax.set_title(name, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    ai = [r["flops"] / r["bytes"] for r in timed if r["bytes"]]
    if ai:
        xs = [min(ai) / 2, max(max(ai) * 2, 2 * PEAK_TFLOPS["fp8"] * 1e3 / copy_gbs)]
        for label, peak in PEAK_TFLOPS.items():
            ridge = peak * 1e3 / copy_gbs  # FLOP/byte where the copy bandwidth meets the peak
            ax.plot([xs[0], ridge, xs[1]], [xs[0] * copy_gbs / 1e3, peak, peak], "k--" if label == "fp8" else "k:",
                    linewidth=1, label=f"{label} {peak:.0f} TFLOPS / copy {copy_gbs:.0f} GB/s")  # fmt: skip
        for impl in IMPLS:
            pts = [(r["flops"] / r["bytes"], r["tflops"]) for r in timed if r["impl"] == impl and r["bytes"]]
            if pts:
                ax.scatter(*zip(*pts), marker=markers[impl], label=impl, s=18)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("FLOP / byte (touched weights + x + out)")
        ax.set_ylabel("TFLOPS")
        ax.set_title("roofline", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, f"MoE layer (routed experts), {device}", path)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="models: " + ", ".join(m.name for m in MODELS))  # fmt: skip
    add_output_args(parser, "bench_moe.json")
    parser.add_argument("--only", default=None, help="only models whose name contains this substring (case-insensitive)")
    parser.add_argument("--tokens", default=None, help=f"comma-separated T values (default {','.join(map(str, TOKENS))})")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ", ".join(IMPLS))
    parser.add_argument("--reps", type=int, default=50, help="timed replays per row (median)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-time budget; later rows are skipped")
    args = parser.parse_args(argv)
    png = png_path(args)
    tokens = parse_tokens(args.tokens, TOKENS)
    wanted = [i.strip() for i in args.impls.split(",") if i.strip()]
    if bad := [i for i in wanted if i not in IMPLS]:
        raise SystemExit(f"--impls: unknown {bad}, choose from {IMPLS}")
    models = [m for m in MODELS if not args.only or args.only.lower() in m.name.lower()]
    if not models:
        raise SystemExit(f"--only {args.only!r} matches no model ({', '.join(m.name for m in MODELS)})")
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe.py needs a CUDA GPU (torch.cuda.is_available() is False)")

    from cute_moe.timing import Timer  # noqa: PLC0415

    t0 = time.monotonic()
    timer = Timer()
    copy_gbs = timer.copy_bandwidth_gbs()
    device = torch.cuda.get_device_name()
    impls: dict[str, Any] = {}
    probes: dict[str, str] = {}
    if "cute_moe" in wanted:
        factory, probes["cute_moe"] = probe_cute_moe()
        impls["cute_moe"] = factory if factory is not None else probes["cute_moe"]
    for kind in ("torch_fp8_rowwise", "torch_bf16"):
        if kind in wanted:
            align, probes[kind] = probe_torch_peer(kind)
            impls[kind] = align if align is not None else probes[kind]
    torch.cuda.empty_cache()
    print(f"device: {device}   torch {torch.__version__}   copy bandwidth (read+write): {copy_gbs:.0f} GB/s")
    for k, v in probes.items():
        print(f"probe {k}: {v}")

    rows: list[dict] = []
    for m in models:
        if time.monotonic() - t0 > args.budget_s:
            rows += [{"model": m.name, "T": t, "impl": "*", "us": None, "note": "skipped: --budget-s spent"}
                     for t in tokens]  # fmt: skip
            continue
        seed_from(m.name)  # the same weights, score bias and so routing in every run
        try:
            w = make_weights(m, rowwise=not isinstance(impls.get("torch_fp8_rowwise", ""), str),
                             bf16=not isinstance(impls.get("torch_bf16", ""), str))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 (e.g. out of memory)
            rows += [{"model": m.name, "T": t, "impl": "*", "us": None, "note": _fmt_exc(exc)} for t in tokens]
            torch.cuda.empty_cache()
            continue
        for t in tokens:
            if time.monotonic() - t0 > args.budget_s:
                rows.append({"model": m.name, "T": t, "impl": "*", "us": None, "note": "skipped: --budget-s spent"})
                continue
            try:
                rows += bench_point(timer, m, w, t, impls, args.reps)
            except Exception as exc:  # noqa: BLE001
                rows.append({"model": m.name, "T": t, "impl": "*", "us": None, "note": _fmt_exc(exc)})
            torch.cuda.empty_cache()
            print(f"  {m.name} T={t}: done at {time.monotonic() - t0:.0f} s", flush=True)
        del w
        torch.cuda.empty_cache()

    print_table(rows, copy_gbs)
    write_json(args.json, {"device": device, "torch": torch.__version__, "copy_gbs": copy_gbs,
                           "peak_tflops": PEAK_TFLOPS, "probes": probes, "rows": rows})  # fmt: skip
    print(f"json: {args.json}")
    plot(rows, copy_gbs, png, device)


if __name__ == "__main__":
    main()
