"""The planner's measured facts ship with the package: ``fusedpar/plan/measured.json`` is what
``benchmarks/report.py`` makes of the committed rows, the planner reads it (not
``benchmarks/results``), and a wheel built from this tree plans GPT-2 XL exactly as the
checkout does."""

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fusedpar.plan import plan, speed

ROOT = Path(__file__).parents[2]
GPT2_XL = {"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25, "vocab_size": 50257}
PLAN = ("import fusedpar, fusedpar.plan as p; print(fusedpar.__file__); print(p.plan("
        f"{GPT2_XL}, 2, '24GiB', seq_len=1024, global_batch=2, gpu='H100').to_json())")


def test_package_data_is_the_reports_output(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    shipped = (ROOT / "fusedpar" / "plan" / "measured.json").read_text()
    assert report.planner_facts(report.load(ROOT / "benchmarks" / "results")) == shipped


def test_the_planner_reads_the_package_data(monkeypatch, tmp_path):
    (tmp_path / "measured.json").write_text(json.dumps({"matmul_peaks": [
        {"device": "NVIDIA H100 test", "tflops": 123.0, "source": "a test row"}]}))
    monkeypatch.setattr(speed.resources, "files", lambda package: tmp_path)
    assert speed.measured_peak_tflops("H100") == (123.0, "a test row")
    assert speed.measured_peak_tflops("A100") is None


@pytest.mark.timeout(120)
def test_a_wheel_plans_as_the_checkout(tmp_path):
    """The wheel (pure Python build) unpacked alone on the path, run outside the checkout."""
    env = {"FUSEDPAR_SKIP_CUDA_BUILD": "1", "PATH": "/usr/bin:/bin"}
    info = ROOT / "fusedpar" / "_build_info.py"  # the build writes it in the tree: keep this one's
    kept = info.read_bytes() if info.exists() else None
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(ROOT)], check=True, env=env, timeout=100)
    finally:
        if kept is None:
            info.unlink(missing_ok=True)
        else:
            info.write_bytes(kept)
    with zipfile.ZipFile(next((tmp_path / "dist").glob("fusedpar-*.whl"))) as wheel:
        wheel.extractall(tmp_path / "site")

    out = subprocess.run([sys.executable, "-c", PLAN], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path / "site")}, timeout=100)
    assert out.returncode == 0, out.stderr
    where, _, wheel_plan = out.stdout.partition("\n")
    assert where.startswith(str(tmp_path / "site")), where  # the wheel's fusedpar, not this tree's
    assert json.loads(wheel_plan) == json.loads(plan(GPT2_XL, 2, "24GiB", seq_len=1024, global_batch=2,
                                                     gpu="H100").to_json())
    assert json.loads(wheel_plan)["device"]["peak_source"].startswith("measured:")
