"""bench.learner_gpu's smoke mode on the CPU: every code path of the GPU benchmark, so a broken bench fails here.

One run (tiny model, float32, gloo): FleetRL's trainer with a token budget and gradient checkpointing,
the plain PyTorch loop, WeightSource.snapshot, the bucket copy and the world-size-1 broadcast.
"""

import os
import re
import subprocess
import sys
import time

from conftest import ROOT

SPEED_HEADER = "| case | loop | s/update | tokens/s | MFU | peak GiB | FleetRL / plain | loss, update 1 |"
WEIGHT_HEADER = "| case | params | weights GB | snapshot GB/s | snapshot device | bucket copy GB/s | broadcast GB/s | backend |"
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(lines: list[str], header: str) -> list[list[str]]:
    """The rows of the markdown table under `header` (after its separator line), up to the first non-row."""
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def _number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("x%"))


def test_smoke_reports_every_figure(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}  # the sides make their own rendezvous
    # On the GPU machine the carried packages are found only through PYTHONPATH (installed with --target): every
    # side process must keep it. This folder on it marks each Python process that started with it.
    site, seen = tmp_path / "site", tmp_path / "seen"
    site.mkdir(), seen.mkdir()
    (site / "sitecustomize.py").write_text(f"import os\nopen(os.path.join({str(seen)!r}, str(os.getpid())), 'w').close()\n")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.learner_gpu", "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert len(list(seen.iterdir())) >= 3, "the side processes lost PYTHONPATH"  # the bench and its two sides at least
    out = proc.stdout.splitlines()
    assert "command: python -m bench.learner_gpu --smoke" in out
    assert any(line.startswith("machine: CPU") and "torch 2." in line for line in out), out
    assert any(line.startswith("MFU peak: 989 TFLOP/s") for line in out), out
    speed = {row[1]: row for row in _table(out, SPEED_HEADER)}
    assert set(speed) == {"FleetRL", "plain PyTorch"} and all(row[0] == "tiny" for row in speed.values()), speed
    fleet, plain = speed["FleetRL"], speed["plain PyTorch"]
    for row in (fleet, plain):
        assert _number(row[2]) > 0 and _number(row[3]) > 0, row  # s/update, tokens/s
        assert row[4].endswith("%") and row[5] == "-", row  # MFU; no CUDA peak memory on the CPU
    assert re.fullmatch(r"\d+\.\d\dx", fleet[6]), fleet
    assert abs(_number(fleet[6]) - _number(fleet[3]) / _number(plain[3])) < 0.02 * _number(fleet[6]) + 0.01
    # Same initial weights, samples and loss in float32: the first update's loss agrees (the same work).
    assert abs(_number(fleet[7]) - _number(plain[7])) <= 1e-4 * abs(_number(plain[7])), (fleet, plain)

    (weights,) = _table(out, WEIGHT_HEADER)
    assert weights[0] == "tiny"
    assert weights[1].endswith("M") and _number(weights[1][:-1]) > 0
    assert all(_number(weights[i]) > 0 for i in (2, 3, 5, 6)), weights
    assert weights[7] == "gloo" and weights[4] == "cpu", weights
    text = proc.stdout
    assert "world size 1" in text and "call path, not a link" in text


def test_a_side_out_of_time_is_one_line_and_a_failed_run():
    """--timeout and --budget bound each side (the GPU check's bench stage has a cap of its own): a side that runs
    out of time is killed and named in one line with the bound it hit; the table is printed all the same."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.learner_gpu", "--smoke", "--timeout", "0.5", "--budget", "0.8"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # No side starts, imports torch and finishes a model in half a second: the first is killed at --timeout, the
    # second gets the 0.3 s left of --budget, and nothing is left for a third.
    assert lines[0] == "tiny FleetRL: out of time: no result within 0.5 s (--timeout 0.5 s)", lines[:2]
    second = (
        r"tiny plain PyTorch: (out of time: no result within 0\.\d s \(what was left of --budget 0\.8 s\)|not run: --budget 0\.8 s spent)"
    )
    assert re.fullmatch(second, lines[1]), lines[:2]
    assert SPEED_HEADER in lines and WEIGHT_HEADER in lines
    assert time.monotonic() - t0 < 60  # killed, not waited for
