"""What `pip install` puts into site-packages: everything under the paged_backend namespace (no
top-level kernels/scheduler/integration, names other PyPI distributions own), and no module of
the repository still importing the old top-level names."""
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_IMPORT = re.compile(r"^\s*(from|import) (kernels|scheduler|integration)\b", re.M)


def test_wheel_installs_only_the_namespace(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("paged_backend-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"paged_backend"}, tops
    for sub in ("kernels/decode.py", "scheduler/scheduler.py", "integration/__init__.py"):
        assert f"paged_backend/{sub}" in names, sub


def test_no_module_imports_the_old_top_level_names():
    files = [p for d in ("paged_backend", "kernels", "scheduler", "integration", "tests", "benchmarks")
             for p in (ROOT / d).rglob("*.py")]
    bad = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}" for p in files for m in OLD_IMPORT.finditer(p.read_text())]
    assert not bad, bad
