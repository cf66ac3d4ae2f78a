"""Run import-linter on the installed layout of the package.

The repository keeps ``patches/`` and ``recipes/`` at the top level and installs them as
``moe_plugins.patches`` and ``moe_plugins.recipes`` (setup.py's package_dir). import-linter (grimp) finds
a package's modules by walking its directory, so it would not see those two. This script assembles the
installed layout in a temporary directory, puts it first on the import path (ahead of the editable install's
finder) and runs the contracts in ``.importlinter`` on it. Exit status: lint-imports'.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="moe-plugins-lint-") as tmp:
        pkg = Path(tmp) / "moe_plugins"
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / "moe_plugins", pkg, ignore=ignore)
        shutil.copytree(ROOT / "patches", pkg / "patches", ignore=ignore)
        shutil.copytree(ROOT / "recipes", pkg / "recipes", ignore=ignore)
        # .importlinter marks these two layers optional (for a plain `lint-imports` in the checkout); here they
        # must be present, or their part of the contract would pass unchecked
        for layer in ("patches", "recipes"):
            if not (pkg / layer / "__init__.py").is_file():
                raise SystemExit(f"lint_imports: the assembled layout lacks moe_plugins.{layer}")
        # drop the editable install's finders so that `moe_plugins` resolves to the assembled tree
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", "")).lower()]
        sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in str(getattr(h, "__module__", "")).lower()]
        sys.path_importer_cache.clear()
        sys.path.insert(0, tmp)
        for name in [m for m in sys.modules if m == "moe_plugins" or m.startswith("moe_plugins.")]:
            del sys.modules[name]
        os.chdir(tmp)              # lint-imports puts the working directory first on the path
        from importlinter.cli import lint_imports
        return lint_imports(config_filename=str(ROOT / ".importlinter"), no_cache=True)


if __name__ == "__main__":
    sys.exit(main())
