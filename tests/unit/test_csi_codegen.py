"""The committed CSI modules are what grpcio-tools generates from objcache/csi/csi.proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_generated_csi_modules_are_current(tmp_path: Path) -> None:
    work = tmp_path / "objcache" / "csi"
    work.mkdir(parents=True)
    shutil.copy(ROOT / "objcache" / "csi" / "csi.proto", work)
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gen-csi.sh", tmp_path / "scripts")
    subprocess.run(["bash", str(tmp_path / "scripts" / "gen-csi.sh")], check=True,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    for name in ("csi_pb2.py", "csi_pb2_grpc.py"):
        assert (work / name).read_text() == (ROOT / "objcache" / "csi" / name).read_text(), \
            f"{name} is stale: run scripts/gen-csi.sh"
