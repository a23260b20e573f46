"""pyproject.toml's package list and package data: a wheel (``pip install .``, not editable) must
carry every tilec package, the codegen templates and the runtime headers that codegen and nvcc read
(``tilec.codegen.build.runtime_dir`` finds the installed copy at tilec/codegen/runtime)."""
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed():
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tilec").rglob("__init__.py")}
    assert set(CONFIG["packages"]) == found | {"tilec.codegen.runtime"}
    assert CONFIG["package-dir"] == {"tilec.codegen.runtime": "runtime"}


def test_package_data_covers_the_templates_and_the_runtime_headers():
    data = CONFIG["package-data"]
    templates = sorted(p.name for p in (ROOT / "tilec" / "codegen" / "templates").iterdir())
    assert templates and all(p.endswith(".j2") for p in templates) and data["tilec.codegen"] == ["templates/*.j2"]
    headers = sorted(p.name for p in (ROOT / "runtime" / "tilec").iterdir())
    assert headers and all(p.endswith(".cuh") for p in headers) and data["tilec.codegen.runtime"] == ["tilec/*.cuh"]
