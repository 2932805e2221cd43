"""bench/probe_power.py's CPU-side part: reading nvidia-smi's samples."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import probe_power  # noqa: E402


def test_parse_samples_reads_numbers_and_drops_unavailable_samples():
    lines = ["1425, 3201, 693.12", "", "[N/A], 3201, 690.00", "1470, 3201, 705.5", "garbage"]
    assert probe_power.parse_samples(lines) == [(1425.0, 3201.0, 693.12), (1470.0, 3201.0, 705.5)]
