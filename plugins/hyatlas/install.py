"""Links this plugin into $HERMES_HOME/plugins/hyatlas and points its server_cwd at this repo."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


def install(hermes_home: Path, *, copy: bool = False) -> Path:
    """Links (or copies) the plugin folder into hermes_home/plugins; returns the target path."""
    import shutil

    source = Path(__file__).resolve().parent
    target = hermes_home / "plugins" / "hyatlas"
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    if copy:
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        target.symlink_to(source, target_is_directory=True)
    return target


def _settings_module() -> ModuleType:
    """settings.py on its own: the package's __init__ needs Hermes, the installer must not."""
    name = "_hyatlas_install_settings"
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("settings.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    """Command line: python plugins/hyatlas/install.py [--hermes-home DIR] [--copy]."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hermes-home",
                        default=os.environ.get("HERMES_HOME") or str(Path.home() / ".hermes"))
    parser.add_argument("--copy", action="store_true", help="copy instead of a symlink")
    args = parser.parse_args(argv)
    home = Path(args.hermes_home).expanduser()
    target = install(home, copy=args.copy)
    repo = Path(__file__).resolve().parent.parent.parent
    _settings_module().save_config({"server_cwd": str(repo)}, home)
    print(f"installed {target}; server_cwd={repo} in {home / 'hyatlas.json'}")
    print("next: hermes memory setup   (choose hyatlas)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
