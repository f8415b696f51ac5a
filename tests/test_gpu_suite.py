"""bench/gpu.py in its CPU reduced mode: every row of the suite gets a status, the CUDA-only ones say so, and the
rows that run on a CPU produce their numbers through the real recipes (tiny settings).

torch.compile is left out here (--skip): compiling cold costs ~30 s on this 2-core machine, more than the rest of
the suite; `python bench/gpu.py --cpu` runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT, env


def test_gpu_suite_cpu_mode_reports_every_row(tmp_path):
    out = tmp_path / "suite"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--cpu", "--out", str(out), "--skip", "torch_compile"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "suite.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert report["mode"] == "cpu-reduced"
    assert list(rows) == ["cifar_5_seeds", "bf16", "fp16", "fp8", "torch_compile", "overhead", "peak_memory"]
    for name, row in rows.items():
        assert row["status"] == "ok" or row["status"].startswith(("skipped: ", "failed: ")), (name, row)
        assert name in proc.stdout  # the printed table has the row too
    # CUDA-only checks are skipped, and say why
    assert rows["fp16"]["status"].startswith("skipped: needs CUDA")
    assert rows["fp8"]["status"].startswith("skipped: needs CUDA")
    assert rows["torch_compile"]["status"] == "skipped: --skip"
    # what a CPU can run did run, with numbers from the real runs
    for name in ("cifar_5_seeds", "bf16", "overhead", "peak_memory"):
        assert rows[name]["status"] == "ok", (name, rows[name])
    cifar = rows["cifar_5_seeds"]["metrics"]
    assert cifar["seeds"] == 2 and 0 <= cifar["accuracy_mean"] <= 1 and cifar["images_per_s_mean"] > 0
    assert rows["bf16"]["metrics"]["mixed_precision"] == "bf16" and rows["bf16"]["metrics"]["skipped_steps"] == 0
    overhead = rows["overhead"]["metrics"]
    assert overhead["plain_ms_per_step"] > 0 and overhead["trainer_ms_per_step"] > 0
    assert rows["peak_memory"]["metrics"]["peak_memory_mb"] > 0
    assert all(r.get("met") is None for r in rows.values())  # goals are judged on a GPU only
