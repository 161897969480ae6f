"""The project's shape: the core stays free of the serving stack, nothing refers to paths
outside the repository, and the benchmark's questions ship inside the package."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVING_MODULES = ("ray", "grpc", "fastapi", "httpx", "deployments", "protos")


def test_no_specdec_core_module_imports_the_serving_stack():
    """Every module of specdec_core, imported in a fresh interpreter, leaves ray, grpc, fastapi,
    httpx, deployments and protos unimported."""
    script = f"""
import importlib, json, pkgutil, sys
import specdec_core
modules = [info.name for info in pkgutil.walk_packages(specdec_core.__path__, "specdec_core.")]
for name in modules:
    importlib.import_module(name)
loaded = sorted({{name.split(".")[0] for name in sys.modules}} & set({SERVING_MODULES!r}))
print(json.dumps({{"modules": modules, "serving": loaded}}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"specdec_core.engine", "specdec_core.tools.cli", "specdec_core.kernels.int4"} <= set(report["modules"])
    assert report["serving"] == []


def test_nothing_refers_to_paths_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    texts = [
        path
        for path in tracked
        if (Path(path).suffix in (".py", ".md", ".yaml", ".toml", ".proto") or path == "Makefile")
        and path != "tests/test_layout.py"  # this file names what it looks for
    ]
    assert "README.md" in texts and "specdec_core/engine.py" in texts
    for path in texts:
        content = (ROOT / path).read_text()
        for outside in ("../shared", "shared/DESIGN", "DESIGN.md", "papers/"):
            assert outside not in content, f"{path} refers to {outside}"


def test_spec_bench_questions_ship_with_the_package():
    import specdec_core
    from specdec_core.questions import DEFAULT_QUESTIONS, load_questions

    package_dir = Path(specdec_core.__file__).parent
    assert DEFAULT_QUESTIONS.is_relative_to(package_dir)
    assert "Apache License" in (DEFAULT_QUESTIONS.parent / "LICENSE").read_text()
    questions = load_questions(DEFAULT_QUESTIONS, ["all"], 1000)
    assert len(questions) == 480 and len({question["category"] for question in questions}) == 13
    # --skip: each category's next questions after its first N (tuning on other questions than a bench's)
    qa = [question for question in questions if question["category"] == "qa"]
    assert load_questions(DEFAULT_QUESTIONS, ["qa", "rag"], 3, skip=40)[:3] == qa[40:43]
    assert len(load_questions(DEFAULT_QUESTIONS, ["writing"], 5, skip=8)) == 2  # it has 10
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"data/spec_bench/*"' in pyproject  # installed as package data, not only in a checkout
