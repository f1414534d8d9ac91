"""The PyInstaller spec, run as a dry run: PyInstaller's build classes are stubs that record
their arguments, so the spec's logic (the model check, the lists, the filters, one-folder
mode) is exercised in well under a second without PyInstaller, torch or a real model."""
from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest

import models
from models import paths

from .conftest import PACKAGING, ROOT, load

REQUIRED_HIDDEN = [
    "transformers.models.llama.configuration_llama",
    "transformers.models.llama.tokenization_llama",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.configuration_gpt2",
    "transformers.models.gpt2.tokenization_gpt2",
    "transformers.models.qwen2.configuration_qwen2",
    "transformers.models.qwen2.tokenization_qwen2",
    "transformers.models.mistral.configuration_mistral",
    "transformers.modeling_gguf_pytorch_utils",
    "transformers.integrations.ggml",
    "transformers.integrations.gguf.gguf_tokenizer_mapping",
]


class _Recorder:
    calls: list = []

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        type(self).calls.append(self)


def _stubs():
    class Analysis(_Recorder):
        calls = []

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scripts, self.pure = ["entry"], ["pure"]
            # What torch's hook collects, some of which the spec must drop.
            self.binaries = [
                ("torch/lib/libtorch_cpu.so", "/x/libtorch_cpu.so", "BINARY"),
                ("torch/lib/libtorchbind_test.so", "/x/libtorchbind_test.so", "BINARY"),
                ("torch/bin/test_api", "/x/test_api", "BINARY"),
                ("torch/bin/torch_shm_manager", "/x/torch_shm_manager", "BINARY"),
            ]
            self.datas = [
                ("torch/include/ATen/core/Tensor.h", "/x/Tensor.h", "DATA"),
                ("torch/test/Dict_test", "/x/Dict_test", "DATA"),
                (paths.BUNDLED_MODELS_SUBDIR + "/m.gguf", "/x/m.gguf", "DATA"),
            ]

    class PYZ(_Recorder):
        calls = []

    class EXE(_Recorder):
        calls = []

    class COLLECT(_Recorder):
        calls = []

    class BUNDLE(_Recorder):
        calls = []

    return {"Analysis": Analysis, "PYZ": PYZ, "EXE": EXE, "COLLECT": COLLECT, "BUNDLE": BUNDLE}


def _run_spec(monkeypatch, tmp_path, platform="linux", installed=True, verified=True):
    model = tmp_path / models.DEFAULT_MODEL.filename
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "installed_path", lambda entry=None: model if installed else None)
    monkeypatch.setattr(models, "verify", lambda entry=None: verified)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the spec prepends the repo root
    hooks = types.ModuleType("PyInstaller.utils.hooks")  # PyInstaller is not installed for the tests
    hooks.copy_metadata = lambda name: [(f"/site-packages/{name}-1.0.dist-info", f"{name}-1.0.dist-info")]
    hooks.collect_dynamic_libs = lambda name: [(f"/site-packages/{name}/lib/lib{name}.so", f"{name}/lib")]
    for name, module in (("PyInstaller", types.ModuleType("PyInstaller")),
                         ("PyInstaller.utils", types.ModuleType("PyInstaller.utils")),
                         ("PyInstaller.utils.hooks", hooks)):
        monkeypatch.setitem(sys.modules, name, module)
    namespace = {"SPECPATH": str(PACKAGING), "__file__": str(PACKAGING / "attnchat.spec"), **_stubs()}
    code = compile((PACKAGING / "attnchat.spec").read_text(), str(PACKAGING / "attnchat.spec"), "exec")
    exec(code, namespace)
    return namespace, model


def test_spec_is_valid_python():
    ast.parse((PACKAGING / "attnchat.spec").read_text())


def test_spec_dry_run_linux(monkeypatch, tmp_path, bundle):
    ns, model = _run_spec(monkeypatch, tmp_path)
    (analysis,) = ns["Analysis"].calls
    assert analysis.args[0] == [str(bundle.ENTRY_SCRIPT)]
    assert bundle.ENTRY_SCRIPT.is_file()
    kw = analysis.kwargs
    assert (str(model), paths.BUNDLED_MODELS_SUBDIR) in kw["datas"]
    assert ("/site-packages/gguf-1.0.dist-info", "gguf-1.0.dist-info") in kw["datas"]  # transformers checks its version
    for name in REQUIRED_HIDDEN:
        assert name in kw["hiddenimports"], name
    assert "attnchat.bench.worker" in kw["hiddenimports"]
    # Not the whole of transformers: most families are excluded, none that we need.
    family_excludes = [e for e in kw["excludes"] if e.startswith("transformers.models.")]
    assert len(family_excludes) > 100
    assert "transformers.models.bert" in family_excludes
    for kept in ("llama", "gpt2", "qwen2", "mistral", "auto", "gemma", "t5"):
        assert f"transformers.models.{kept}" not in kw["excludes"]
    assert "transformers.pipelines" in kw["excludes"] and "tkinter" in kw["excludes"]
    # One-folder mode: the exe leaves the binaries to COLLECT.
    (exe,) = ns["EXE"].calls
    assert exe.kwargs["exclude_binaries"] is True and exe.kwargs["name"] == "attnchat"
    assert exe.kwargs["upx"] is False
    (coll,) = ns["COLLECT"].calls
    assert coll.kwargs["name"] == "attnchat"
    assert ns["BUNDLE"].calls == []
    # The filters ran: test binaries and headers gone, the library, shm manager and model kept.
    a = ns["a"]
    kept = {dest for dest, *_ in a.binaries + a.datas}
    assert kept == {"torch/lib/libtorch_cpu.so", "torch/bin/torch_shm_manager",
                    paths.BUNDLED_MODELS_SUBDIR + "/m.gguf"}


def test_spec_dry_run_windows_has_window_and_console_exes(monkeypatch, tmp_path, bundle):
    ns, _ = _run_spec(monkeypatch, tmp_path, platform="win32")
    exes = {e.kwargs["name"]: e.kwargs for e in ns["EXE"].calls}
    assert exes["attnchat"]["console"] is False and exes["attnchat-cli"]["console"] is True
    assert exes["attnchat"]["icon"] == str(bundle.ICON_ICO)
    (coll,) = ns["COLLECT"].calls
    assert len([a for a in coll.args if isinstance(a, ns["EXE"])]) == 2


def test_spec_dry_run_macos_makes_an_app(monkeypatch, tmp_path, bundle):
    ns, _ = _run_spec(monkeypatch, tmp_path, platform="darwin")
    (app,) = ns["BUNDLE"].calls
    assert app.kwargs["name"] == "attnchat.app" and app.kwargs["icon"] == str(bundle.ICON_ICNS)
    assert app.kwargs["version"] == bundle.version()


@pytest.mark.parametrize("installed, verified", [(False, False), (True, False)])
def test_spec_refuses_to_build_without_a_good_model(monkeypatch, tmp_path, installed, verified):
    with pytest.raises(SystemExit, match="attnchat models fetch"):
        _run_spec(monkeypatch, tmp_path, installed=installed, verified=verified)


def test_hidden_imports_exist_in_the_installed_transformers(bundle):
    root = bundle._transformers_root()
    assert root is not None
    for name in bundle.transformers_hidden_imports(root):
        rel = Path(*name.split(".")[1:])
        assert (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file(), name


def test_excludes_never_cover_a_hidden_import(bundle):
    excluded = bundle.excludes()
    for name in bundle.hidden_imports():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            assert ".".join(parts[:i]) not in excluded, name


def test_bundled_models_folder_name_agrees(bundle):
    assert bundle.BUNDLED_MODELS_SUBDIR == paths.BUNDLED_MODELS_SUBDIR


@pytest.mark.parametrize("dest, dropped", [
    ("torch/bin/test_jit", True),
    ("torch/bin/torch_shm_manager", False),
    ("torch/lib/libtorch_cpu.so", False),
    ("torch/lib/libjitbackend_test.so", True),
    ("torch/include/c10/core/Device.h", True),
    ("torch\\test\\Dict_test", True),
    ("PySide6/Qt/plugins/platforms/libqoffscreen.so", False),
    ("bundled_models/SmolLM2-135M-Instruct.Q4_1.gguf", False),
])
def test_drop_from_bundle(bundle, dest, dropped):
    assert bundle.drop_from_bundle(dest) is dropped


def test_package_requirements_are_pinned():
    lines = [ln.split("#")[0].strip() for ln in (PACKAGING / "requirements-package.txt").read_text().splitlines()]
    reqs = [ln for ln in lines if ln]
    names = {r.split("==")[0].strip().lower() for r in reqs}
    assert {"pyinstaller", "pyinstaller-hooks-contrib"} <= names
    assert all("==" in r for r in reqs), reqs


def test_makefile_package_target():
    text = (ROOT / "Makefile").read_text()
    assert "\npackage:" in text
    recipe = text.split("\npackage:", 1)[1].split("\n\n", 1)[0]
    assert "packaging/requirements-package.txt" in text
    assert "PyInstaller" in recipe and "packaging/attnchat.spec" in recipe
    assert "packaging/build_deb.py" in recipe
    test_recipe = text.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "package" not in test_recipe and "PyInstaller" not in test_recipe
