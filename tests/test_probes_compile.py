"""The device probes in bench/ (*.cu, run by the device plans) compile for sm_90a, so a plan
does not spend device time on a build error. Needs nvcc (skipped without one)."""

import shutil
import subprocess
from pathlib import Path

import pytest

PROBES = sorted((Path(__file__).resolve().parent.parent / "bench").glob("*.cu"))


@pytest.mark.parametrize("probe", PROBES, ids=lambda path: path.stem)
def test_probe_compiles_for_sm90a(tmp_path, probe):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    binary = tmp_path / probe.stem
    command = [nvcc, "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "-lineinfo", "-o", str(binary)]
    result = subprocess.run([*command, str(probe)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert binary.stat().st_size > 0  # compiled and linked, as the plans build them


def test_the_probes_are_found():
    assert {"probe_gather", "probe_role_barrier", "probe_ws_barrier"} <= {p.stem for p in PROBES}
