"""The main job runs on this machine and checks what it prints as passed."""
import subprocess
import sys


def test_main_job_self_checks():
    proc = subprocess.run([sys.executable, "-m", "cute_moe"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    passed, _, total = last.split()[:3]
    assert passed == total and int(total) >= 9, last


def test_main_job_runs_on_the_cpu_on_a_gpu_without_kernels(monkeypatch):
    """On a GPU the kernels are not built for (an A100, say) the demo checks the ops on the CPU
    and says why, instead of stopping at the first op with NotImplementedError."""
    import torch

    from cute_moe import __main__ as main
    from cute_moe.compiler import arch_of_device_index

    # arch_of_device_index caches per device: on a GPU machine device 0 is already known there.
    arch_of_device_index.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    try:
        device, where = main._pick_device()
    finally:
        monkeypatch.undo()
        arch_of_device_index.cache_clear()
    assert device.type == "cpu" and "compute capability 8.0" in where and "A100" in where


def test_quantized_codes_rule_is_the_documented_one():
    """silu_mul_quant's GPU contract: scales exact; codes identical but on at most 1e-4 of them, each
    one e4m3 step away."""
    import torch

    from cute_moe.__main__ import _codes_within_one_step

    ref_codes = torch.linspace(-448, 448, 20000).to(torch.float8_e4m3fn)
    scales = torch.rand(20000, 1)
    step = ref_codes.view(torch.int8).clone()
    step[5000] += 1  # one code one step away: 1 of 20000 = 5e-5
    assert _codes_within_one_step((step.view(torch.float8_e4m3fn), scales), (ref_codes, scales), None, 1e-4)
    two = step.clone()
    two[6000] += 2
    assert not _codes_within_one_step((two.view(torch.float8_e4m3fn), scales), (ref_codes, scales), None, 1e-4)
    many = step.clone()
    many[7000:7004] += 1
    assert not _codes_within_one_step((many.view(torch.float8_e4m3fn), scales), (ref_codes, scales), None, 1e-4)
    assert not _codes_within_one_step((ref_codes, scales * 1.0000001 + 1e-7), (ref_codes, scales), None, 1e-4)
    # 448 (0x7E) against NaN (0x7F): one bit pattern apart, but never "one step"
    nan = ref_codes.view(torch.uint8).clone()
    top = int((ref_codes.float() == 448).nonzero()[0])
    nan[top] = 0x7F
    assert not _codes_within_one_step((nan.view(torch.float8_e4m3fn), scales), (ref_codes, scales), None, 1e-4)
    # one step across zero (+0 and the smallest negative subnormal), and -0 against +0 (equal)
    zero = torch.zeros(20000, dtype=torch.uint8)
    near = zero.clone()
    near[3] = 0x81
    signed = zero.clone()
    signed[5] = 0x80
    as_fp8 = lambda t: t.view(torch.float8_e4m3fn)  # noqa: E731
    assert _codes_within_one_step((as_fp8(near), scales), (as_fp8(zero), scales), None, 1e-4)
    assert _codes_within_one_step((as_fp8(signed), scales), (as_fp8(zero), scales), None, 0.0)
    assert _codes_within_one_step((ref_codes[:0], scales[:0]), (ref_codes[:0], scales[:0]), None, 1e-4)


def test_finiteness_is_checked_on_the_defined_rows_only():
    """Rows past the last segment of an M_cap buffer are unspecified (NaN from the allocator made
    the demo's w2 GEMM check fail on the H200 with a correct result)."""
    import torch

    from cute_moe.__main__ import _finite

    c = torch.ones(8, 4)
    c[6:] = float("nan")
    assert _finite(c, 6) and not _finite(c, 7) and not _finite(c) and _finite((c[:6], c[:6]))
