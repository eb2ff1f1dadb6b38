"""Install or remove the start-up hook (a .pth file in site-packages).

``python -m omniinfer.cpu.install`` writes it into the running interpreter's site-packages;
scripts/setup.sh does this for the project's .venv. The hook does nothing unless
``SGLANG_USE_CPU_ENGINE=1`` is set on a machine without CUDA or an NPU.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

PTH_NAME = "omniinfer_cpu.pth"
PTH_LINE = "import omniinfer.cpu.startup as _omni_cpu; _omni_cpu.run()\n"


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def install() -> Path:
    path = pth_path()
    path.write_text(PTH_LINE)
    return path


def uninstall() -> bool:
    path = pth_path()
    if path.exists():
        path.unlink()
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omniinfer.cpu.install", description=__doc__)
    parser.add_argument("--uninstall", action="store_true", help="remove the hook")
    args = parser.parse_args(argv)
    if args.uninstall:
        print("removed" if uninstall() else "not installed", pth_path())
    else:
        print("installed", install())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
