"""The wheel's packages: every package folder of the tree is installed, and only inside
jserve's namespace (a top-level `models` would collide with other projects' modules)."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed_under_jserve() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}
    folders = {name: ROOT / name.replace(".", "/") for name in setuptools["packages"] if name not in mapped}
    declared = {name: path.resolve() for name, path in {**folders, **mapped}.items()}
    assert all(name == "jserve" or name.startswith("jserve.") for name in declared)
    on_disk = {init.parent.resolve() for top in ("jserve", "models", "pallas_kernels")
               for init in (ROOT / top).rglob("__init__.py")}
    assert set(declared.values()) == on_disk


def test_models_and_kernels_import_under_jserve_and_import_nothing_above() -> None:
    import jserve.models.registry
    import jserve.pallas_kernels.backends

    assert pathlib.Path(jserve.models.registry.__file__).parent == ROOT / "models"
    assert pathlib.Path(jserve.pallas_kernels.backends.__file__).parent == ROOT / "pallas_kernels"
    for top in ("models", "pallas_kernels"):
        for path in (ROOT / top).rglob("*.py"):
            text = path.read_text()
            assert "from jserve." not in text.replace("from jserve.models", "").replace(
                "from jserve.pallas_kernels", ""), path
