"""Layout and dependency rule of the monorepo; every package builds a wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted((ROOT / "packages").iterdir())
EXPECTED = {
    "loongforge-core",
    "loongforge-llm",
    "loongforge-vlm",
    "loongforge-diffusion",
    "loongforge-embodied",
    "loongforge-xpu",
    "loongforge-kernels",
}


def _deps(pkg: Path) -> list[str]:
    meta = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
    deps = list(meta.get("dependencies", []))
    for extra in meta.get("optional-dependencies", {}).values():
        deps += extra
    return deps


def _name(req: str) -> str:
    import re

    return re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].strip().lower()


def test_all_packages_exist_with_namespace_layout():
    assert {p.name for p in PACKAGES} == EXPECTED
    for pkg in PACKAGES:
        short = pkg.name.removeprefix("loongforge-")
        assert (pkg / "src" / "loongforge" / short / "__init__.py").is_file(), pkg
        assert not (pkg / "src" / "loongforge" / "__init__.py").exists(), "loongforge must stay a namespace package"
        meta = tomllib.loads((pkg / "pyproject.toml").read_text())
        assert meta["build-system"]["build-backend"] == "hatchling.build"


def test_dependency_rule_only_core_is_depended_on():
    for pkg in PACKAGES:
        lf = {_name(d) for d in _deps(pkg) if _name(d).startswith("loongforge")}
        if pkg.name == "loongforge-core":
            assert lf == set(), "core depends on no other LoongForge package"
        else:
            assert lf == {"loongforge-core"}, f"{pkg.name} may depend on loongforge-core only, has {lf}"


def test_core_requirements():
    names = {_name(d): d for d in _deps(ROOT / "packages/loongforge-core")}
    assert "megatron-core" in names and ">=0.16.1" in names["megatron-core"] and "<0.17" in names["megatron-core"]
    assert "==" not in names["torch"], "torch must not be pinned exactly"
    required = {_name(d) for d in tomllib.loads((ROOT / "packages/loongforge-core/pyproject.toml").read_text())["project"]["dependencies"]}
    assert "transformer-engine" not in required, "transformer-engine is optional only"
    for dep in ("torch", "safetensors", "omegaconf", "numpy", "psutil"):
        assert dep in required


def test_every_package_builds_a_wheel(tmp_path):
    for pkg in PACKAGES:
        r = subprocess.run(
            [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(pkg)],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr[-2000:]
    wheels = {w.name.split("-")[0]: w for w in tmp_path.glob("*.whl")}
    assert len(wheels) == 7
    names = zipfile.ZipFile(wheels["loongforge_llm"]).namelist()
    assert "loongforge/llm/configs/tiny.yaml" in names
    assert "loongforge/llm/assets/tiny_corpus.jsonl" in names
    assert "loongforge/llm/configs/sft.yaml" in names
    assert not any(n == "loongforge/__init__.py" for n in names)
    core_names = zipfile.ZipFile(wheels["loongforge_core"]).namelist()
    assert "loongforge/core/data/text/assets/tiny_tokenizer/tokenizer.json" in core_names
    assert "loongforge/core/data/text/assets/tiny_tokenizer/tokenizer_config.json" in core_names
    assert "loongforge/core/data/text/assets/tiny_sft.jsonl" in core_names
    assert "loongforge/core/data/text/assets/chat_templates/llama3.1.jinja" in core_names  # the built-in chat templates
    assert "loongforge/embodied/configs/pi05.yaml" in zipfile.ZipFile(wheels["loongforge_embodied"]).namelist()
    assert not any(n == "loongforge/__init__.py" for n in core_names)
    entry = (
        zipfile.ZipFile(wheels["loongforge_core"])
        .read(next(n for n in zipfile.ZipFile(wheels["loongforge_core"]).namelist() if n.endswith("entry_points.txt")))
        .decode()
    )
    assert "loongforge = loongforge.core.cli:main" in entry
