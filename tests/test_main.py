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
