"""bench/*.py's CPU-side parts: the byte counts (checked against the tensors the references read and
write), bench_small_kernels' cases run once each on the CPU (a dry run with a stand-in timer: every
call, argument list and row field, not a timing), its op selection, table, JSON and plot,
bench_host_overhead's cases and rows, and bench_quant_fp8's and bench_kv_cache's plots (of made-up
rows).  What the GPU measures is not checked here."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_finalize  # noqa: E402
import bench_host_overhead  # noqa: E402
import bench_io  # noqa: E402
import bench_route  # noqa: E402
import bench_small_kernels as bsk  # noqa: E402
from cute_moe import reference as R  # noqa: E402


class DryTimer:
    """Timer's interface on the CPU: each measurement calls fn once and returns a fixed µs."""

    def graph_us(self, fn, reps=100):
        fn()
        return 2.0

    def graph_amortized_us(self, fn, calls=100, reps=20):
        fn()
        return 1.0

    def time_us(self, fn, reps=100):
        fn()
        return 50.0, "graph"


def _routing(t=5, e=16, k=4):
    ids = torch.rand(t, e).argsort(dim=1)[:, :k].to(torch.int32)
    return ids, R.align_ref(ids, e, 128)


def _routed(t2r_or_r2t: torch.Tensor) -> torch.Tensor:
    return t2r_or_r2t >= 0


# ----------------------------------------------------------------------------- bytes counted minimally


def test_route_and_align_bytes_are_their_tensors():
    t, e, k = 7, 32, 4
    logits, bias = torch.randn(t, e), torch.randn(e)
    ids, w = R.route_ref(logits, k, "deepseek_v3", bias, 8, 4, 2.5)
    assert bench_route.route_bytes(t, e, k, True) == logits.nbytes + bias.nbytes + ids.nbytes + w.nbytes
    assert bench_route.route_bytes(t, e, k, False) == logits.nbytes + ids.nbytes + w.nbytes
    outs = R.align_ref(ids, e, bench_route.ALIGNMENT)
    assert bench_route.align_bytes(t, k, e) == ids.nbytes + sum(o.nbytes for o in outs)


def test_gather_and_silu_bytes_are_the_routed_rows():
    """x (or its codes and scales) read once; only the routed rows of the outputs (and of h) counted."""
    t, h, inter = 5, 256, 128
    _, (off, r2t, _, counts) = _routing(t)
    routed, n = _routed(r2t), int(counts.sum())
    assert int(routed.sum()) == n

    def routed_rows(*tensors):
        return sum(v[routed].nbytes for v in tensors)

    x = torch.randn(t, h, dtype=torch.bfloat16)
    assert bsk.permute_quant_bytes(t, h, n) == x.nbytes + routed_rows(*R.permute_quant_ref(x, r2t, off))
    codes, scales = R.quant_fp8_ref(x)
    gathered = R.permute_ref(codes, scales, r2t, off)
    assert bsk.permute_bytes(t, h, n) == codes.nbytes + scales.nbytes + routed_rows(*gathered)
    hh = torch.randn(r2t.shape[0], 2 * inter, dtype=torch.bfloat16)
    assert bsk.silu_mul_quant_bytes(n, inter) == routed_rows(hh, *R.silu_mul_quant_ref(hh, off))


def test_finalize_and_moe_reduce_bytes_are_their_tensors():
    t, h, k = 5, 256, 4
    _, (_, r2t, t2r, counts) = _routing(t, k=k)
    y, w = torch.randn(r2t.shape[0], h, dtype=torch.bfloat16), torch.rand(t, k)
    out = R.finalize_ref(y, w, t2r)
    assert bench_finalize.finalize_bytes(t, h, k, int(counts.sum())) == (
        y[_routed(r2t)].nbytes + t2r.nbytes + w.nbytes + out.nbytes
    )
    hidden = torch.randn(t, k, h, dtype=torch.bfloat16)
    out = R.moe_reduce_ref(hidden, w, False)
    assert bench_finalize.moe_reduce_bytes(t, k, h, 2) == hidden.nbytes + w.nbytes + out.nbytes


# ----------------------------------------------------------------------------- bench_small_kernels


def test_select_ops_and_models():
    assert bsk.select(bsk.OPS, None) == list(bsk.OPS)
    assert bsk.select(bsk.OPS, "permute") == [
        "permute_quant[rows]", "permute_quant[tokens]", "permute_quant[tok,nopad]", "permute"
    ]  # fmt: skip
    assert bsk.select(bsk.OPS, "finalize, MOE_REDUCE") == ["finalize", "moe_reduce[f32 acc]", "moe_reduce[bf16 acc]"]
    assert bsk.select(bsk.MODELS, "qwen") == ["Qwen3-235B"]
    assert bsk.select(bsk.OPS, "nosuch") == []


def test_issue_5_shapes_and_tokens():
    assert bsk.TOKENS == (1, 16, 128, 1024, 4096, 16384)
    dsv3, qwen = bsk.MODELS["DeepSeek-V3"], bsk.MODELS["Qwen3-235B"]
    assert (dsv3["H"], dsv3["E"], dsv3["k"], dsv3["n_group"], dsv3["topk_group"]) == (7168, 256, 8, 8, 4)
    assert (qwen["H"], qwen["E"], qwen["k"]) == (4096, 128, 8)
    assert {op.split("[")[0] for op in bsk.OPS} == {
        "route", "align", "permute_quant", "permute", "silu_mul_quant", "finalize", "moe_reduce"
    }  # fmt: skip


@pytest.mark.parametrize("model", list(bsk.MODELS))
def test_every_case_runs_once_on_the_cpu(model):
    """Each op's call and its plain composition run (the ops' CPU implementations); every row is
    complete, JSON-serializable and its GB/s follows from its bytes."""
    rows = bsk.bench_point(DryTimer(), model, 1, list(bsk.OPS), 4000.0, device="cpu")
    assert [r["op"] for r in rows] == list(bsk.OPS)
    m = bsk.MODELS[model]
    want_bytes = {
        "route": bench_route.route_bytes(1, m["E"], m["k"], m["bias"]),
        "align": bench_route.align_bytes(1, m["k"], m["E"]),
        "permute_quant[tok,nopad]": bsk.permute_quant_bytes(1, m["H"], m["k"]),
        "permute": bsk.permute_bytes(1, m["H"], m["k"]),
        "silu_mul_quant[counts]": bsk.silu_mul_quant_bytes(m["k"], m["I"]),
        "finalize": bench_finalize.finalize_bytes(1, m["H"], m["k"], m["k"]),
        "moe_reduce[bf16 acc]": bench_finalize.moe_reduce_bytes(1, m["k"], m["H"], 2),
    }
    for r in rows:
        assert r["note"] == "" and r["model"] == model and r["T"] == 1 and r["H"] == m["H"]
        assert (r["us"], r["amortized_us"], r["torch_us"], r["torch_timing"]) == (2.0, 1.0, 50.0, "graph")
        assert r["gbs"] == pytest.approx(r["bytes"] / 2.0 / 1e3)
        assert r["pct_copy"] == pytest.approx(100 * r["gbs"] / 4000.0)
        assert r["bytes"] == want_bytes.get(r["op"], r["bytes"])
        assert (r["padding_pct"] is None) == (r["op"] in ("route", "align", "finalize") or "moe_reduce" in r["op"])
    json.dumps(rows)


def test_amortized_only_for_route_align_and_decode_sizes():
    rows = bsk.bench_point(DryTimer(), "Qwen3-235B", 32, ["align", "finalize"], 4000.0, device="cpu")
    assert [(r["op"], r["amortized_us"]) for r in rows] == [("align", 1.0), ("finalize", None)]


def test_a_failing_call_leaves_a_note_and_the_bench_goes_on(monkeypatch):
    class FailingPeer(DryTimer):
        def time_us(self, fn, reps=100):
            raise RuntimeError("out of memory")

    rows = bsk.bench_point(FailingPeer(), "Qwen3-235B", 1, ["finalize"], 4000.0, device="cpu")
    assert rows[0]["us"] == 2.0 and rows[0]["torch_us"] is None
    assert rows[0]["note"] == "torch: failed: RuntimeError: out of memory"

    def broken(m, t, routing):
        raise NotImplementedError("no kernel for this input")

    steps = tuple((ops, broken if "finalize" in ops else build) for ops, build in bsk.STEPS)
    monkeypatch.setattr(bsk, "STEPS", steps)
    rows = bsk.bench_point(DryTimer(), "Qwen3-235B", 1, ["align", "finalize"], 4000.0, device="cpu")
    assert [(r["op"], r["us"]) for r in rows] == [("align", 2.0), ("finalize", None)]
    assert rows[1]["note"] == "failed: NotImplementedError: no kernel for this input"


def _rows_with_a_skipped_point():
    rows = bsk.bench_point(DryTimer(), "Qwen3-235B", 1, ["route", "permute"], 4000.0, device="cpu")
    return rows + [{"model": "Qwen3-235B", "op": "finalize", "T": 16, "us": None, "note": "skipped: --budget-s spent"}]


def test_table_and_json(tmp_path, capsys):
    rows = _rows_with_a_skipped_point()
    bsk.print_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].split()[:4] == ["model", "op", "T", "us"]
    assert lines[2].split()[1:4] == ["permute", "1", "2.00"] and "skipped: --budget-s spent" in lines[3]
    path = tmp_path / "out" / "small.json"
    bench_io.write_json(str(path), {"rows": rows})
    assert json.loads(path.read_text())["rows"][1]["op"] == "permute"


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    bsk.plot(_rows_with_a_skipped_point(), str(tmp_path / "small.png"), "cpu")
    assert (tmp_path / "small.png").stat().st_size > 0


def test_main_refuses_empty_selections_and_needs_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="matches no op"):
        bsk.main(["--only", "nosuch"])
    with pytest.raises(SystemExit, match="matches no model"):
        bsk.main(["--model", "llama"])
    with pytest.raises(SystemExit, match="positive ints"):
        bsk.main(["--tokens", "0"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bsk.main(["--json", str(tmp_path / "x.json")])


def test_parse_tokens():
    assert bench_io.parse_tokens(None, (1, 2)) == (1, 2)
    assert bench_io.parse_tokens("16, 4096", (1,)) == (16, 4096)
    with pytest.raises(SystemExit, match="comma-separated ints"):
        bench_io.parse_tokens("1,x", (1,))


@pytest.mark.parametrize(
    "script", ["bench_small_kernels", "bench_finalize", "bench_route", "bench_host_overhead", "bench_moe",
               "bench_grouped_gemm", "probe_power"],
)  # fmt: skip
def test_help(script, monkeypatch, capsys):
    module = __import__(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 0 and "usage:" in capsys.readouterr().out


# ----------------------------------------------------------------------------- bench_host_overhead


def test_host_overhead_cases_cover_every_op_and_run_on_the_cpu():
    from cute_moe import ops

    via_ops = bench_host_overhead.cases(dev="cpu")
    direct = bench_host_overhead.cases(bench_host_overhead._Direct(), "cpu")
    assert list(via_ops) == list(direct)
    timed_ops = {name.split(" ")[0] for name in via_ops}
    assert set(ops._OPS) <= timed_ops, set(ops._OPS) - timed_ops
    for name in via_ops:
        via_ops[name]()
        direct[name]()
    # the routed layer is the same layer as fused_moe's, given route's top-k
    torch.testing.assert_close(via_ops["fused_moe_routed (small)"](), via_ops["fused_moe (small)"](), rtol=0, atol=0)


def test_host_overhead_rows(capsys):
    names = ("route", "fused_moe_routed (small)")
    best = {(n, memo, p): 10.0 + p + (0 if memo else 5) for n in names for memo in (True, False) for p in (0, 1)}
    rows = bench_host_overhead.table_rows(best, {"route": 2.0, "fused_moe_routed (small)": 9.0})
    assert rows[0] == {"op": "route", "torch_ops_us": 10.0, "functional_us": 11.0, "no_memo_torch_ops_us": 15.0,
                       "no_memo_functional_us": 16.0, "gpu_us": 2.0, "gpu_bound": False}  # fmt: skip
    assert rows[1]["gpu_bound"]  # 10 µs on the host <= 1.2 x 9 µs on the GPU
    bench_host_overhead.print_table(rows)
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[:2] == ["fused_moe_routed", "(small)"] and out[2].endswith("(GPU-bound)")
    json.dumps(rows)


# ----------------------------------------------------------------------------- bench_quant_fp8, bench_kv_cache plots


def _quant_rows():
    """bench_quant_fp8's rows, made up: the ue8m0 kernel 3% slower than the plain one."""
    return [{"T": t, "H": 7168, "scale_fmt": fmt, "us": (2.0 + t / 200) * slower, "gbs": 1.0,
             "pct_copy": min(90.0, 0.5 * t) / slower, "torch_us": 30.0 + t / 20}
            for fmt, slower in (("none", 1.0), ("ue8m0", 1.03)) for t in (1, 128, 4096, 16384)]  # fmt: skip


def _kv_rows():
    """bench_kv_cache's rows, made up."""
    workloads = (("decode B=64", 64), ("prefill 4096", 4096), ("prefill 65536", 65536))
    return [{"config": config, "workload": workload, "tokens": n, "us": 3.0 + n / 1000, "gbs": 1.0,
             "pct_copy": min(95.0, n / 100), "torch_us": 200.0 + n / 10, "eager_us": 2.0 + n / 1000,
             "eager_pct_copy": 1.0, "amortized_us": 1.0 + n / 1200}
            for config in ("llama", "mla") for workload, n in workloads]  # fmt: skip


@pytest.mark.parametrize("script, rows", [("bench_quant_fp8", _quant_rows), ("bench_kv_cache", _kv_rows)])
def test_quant_and_kv_cache_plots(script, rows, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"{script}.png"
    __import__(script).plot(rows(), str(path), "cpu")
    assert path.stat().st_size > 0


def test_quant_and_kv_cache_help_offers_png(monkeypatch, capsys):
    for script in ("bench_quant_fp8", "bench_kv_cache"):
        monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
        with pytest.raises(SystemExit) as stop:
            __import__(script).main()
        assert stop.value.code == 0 and "--png" in capsys.readouterr().out
