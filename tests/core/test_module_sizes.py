"""Each module keeps to one job: none of the package's modules passes 800 lines, and the
PyTorch drop-in's class stays about the size of PyTorch's own (at most 700 lines).

Large modules grow by accretion, a job at a time; the limits make the next job find a
module of its own (docs/development.md, "Where the code is", says which).
"""

from __future__ import annotations

import ast
from pathlib import Path

import scaler_core

#: The most lines a module of the package may have.
MODULE_LINES = 800
#: The most lines the drop-in's GradScaler class may have (PyTorch's is 662).
CLASS_LINES = 700
#: Modules exempt from the limit, with the reason.
EXEMPT = {"_cli/demo.py": "the demo application: a whole training program, by design"}


def _package_files() -> dict[str, Path]:
    package = Path(scaler_core.__file__).parent
    inside = package / "backends"
    backends = inside if inside.is_dir() else package.parent / "backends"
    files = {p.relative_to(package).as_posix(): p for p in package.rglob("*.py")}
    files.update({f"backends/{p.name}": p for p in backends.glob("*.py")})
    return files


def test_no_module_passes_800_lines() -> None:
    files = _package_files()
    assert "torch/_scaler.py" in files
    assert "backends/_torch.py" in files
    sizes = {name: len(path.read_text().splitlines()) for name, path in files.items()}
    over = {n: s for n, s in sizes.items() if s > MODULE_LINES and n not in EXEMPT}
    assert over == {}, f"modules over {MODULE_LINES} lines: {over}; split them by job"
    assert set(EXEMPT) <= set(sizes)


def test_the_drop_in_class_is_about_the_size_of_pytorchs() -> None:
    source = _package_files()["torch/_scaler.py"].read_text()
    (cls,) = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and node.name == "GradScaler"
    ]
    start = min([cls.lineno, *(d.lineno for d in cls.decorator_list)])
    lines = (cls.end_lineno or cls.lineno) - start + 1
    assert lines <= CLASS_LINES, f"GradScaler is {lines} lines; move a job out of the class"
