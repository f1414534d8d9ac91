"""What goes into the frozen app and what its artifacts are called: one table for the
PyInstaller spec, the .deb/tarball builder and the tests.

Stdlib only: the spec imports it inside PyInstaller, the tests import it without
PyInstaller, torch or Qt. ``packaging/`` has no ``__init__.py`` on purpose: a
regular package there would shadow the ``packaging`` library that transformers
and PyInstaller import. The spec, ``build_deb.py`` and the tests load this file by
path (``importlib.util.spec_from_file_location``).

Why the lists look the way they do:

- transformers' ``__init__`` files import every model family under
  ``if TYPE_CHECKING:``; PyInstaller's import scan does not skip those blocks, so
  left alone it bundles all ~500 families. We exclude every family except the ones
  our decoder runs (:data:`TRANSFORMERS_FAMILIES`) and the ones transformers'
  GGUF code imports at module level (:data:`TRANSFORMERS_GGUF_TOKENIZER_FAMILIES`),
  and add back as hidden imports the modules transformers imports by name at run
  time (configuration, modeling for the meta-device skeleton, tokenization).
- torch's hook collects all of torch's files; its C++ test binaries, headers and
  test libraries (~200 MB) are never loaded and are dropped (:func:`drop_from_bundle`).
"""
from __future__ import annotations

import fnmatch
import os
import platform
import re
import tomllib
from pathlib import Path

APP_NAME = "attnchat"
ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
SPEC_FILE = PACKAGING / "attnchat.spec"
ENTRY_SCRIPT = PACKAGING / "entry.py"
DESKTOP_FILE = PACKAGING / "attnchat.desktop"
ICON_PNG = PACKAGING / "attnchat.png"   # 256 x 256
ICON_ICO = PACKAGING / "attnchat.ico"   # Windows (the .exe and the installer)
ICON_ICNS = PACKAGING / "attnchat.icns"  # macOS (the .app)
NSIS_SCRIPT = PACKAGING / "attnchat.nsi"
DIST_DIR = ROOT / "dist"
APP_DIR = DIST_DIR / APP_NAME            # PyInstaller's one-folder output
BUNDLED_MODELS_SUBDIR = "bundled_models"  # must equal models.paths.BUNDLED_MODELS_SUBDIR

#: The families our decoder runs; transformers imports their modules by name.
TRANSFORMERS_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2")
#: Imported at module level by transformers.integrations.gguf.gguf_tokenizer_mapping.
TRANSFORMERS_GGUF_TOKENIZER_FAMILIES = ("gemma", "t5", "qwen3_5")
#: transformers' own plumbing under transformers/models.
TRANSFORMERS_MODELS_PLUMBING = ("auto", "encoder_decoder")
#: Never imported by attnchat at run time (training, pipelines, exporters, the CLI).
TRANSFORMERS_TOP_LEVEL_EXCLUDES = (
    "cli", "commands", "data", "exporters", "hf_argparser", "hyperparameter_search", "modelcard",
    "optimization", "pipelines", "testing_utils", "time_series_utils", "trainer", "trainer_callback",
    "trainer_jit_checkpoint", "trainer_optimizer", "trainer_pt_utils", "trainer_seq2seq",
    "training_args", "training_args_seq2seq",
)
#: Modules that are not used, or whose libraries are not installed for the app.
EXCLUDES = (
    "tkinter", "_tkinter", "matplotlib", "IPython", "jedi", "notebook", "pytest", "_pytest",
    "hypothesis", "PyQt5", "PyQt6", "PySide2", "scipy", "pandas", "sklearn",
    "tensorboard", "torch.utils.tensorboard", "caffe2", "triton", "onnx", "onnxscript",
    "torchvision", "torchaudio", "tensorflow", "jax", "flax", "numba", "importlinter", "grimp",
    "pyqtgraph.examples", "hf_xet",
)
#: attnchat's own modules reached only by name: ``sys.executable -m attnchat.bench.worker``, and
#: the chat-template sandbox's child (``-m models.safety.template_worker``, with jinja2's sandbox).
APP_HIDDEN_IMPORTS = ("attnchat.bench.worker", "models.safety.template_worker", "jinja2.sandbox", "jinja2.ext")
#: transformers modules reached only by name (the GGUF reader and the lazy auto classes).
TRANSFORMERS_HIDDEN_IMPORTS = (
    "transformers.modeling_gguf_pytorch_utils",
    "transformers.integrations.ggml",
    "transformers.integrations.gguf",
    "transformers.integrations.gguf.dequant",
    "transformers.integrations.gguf.gguf_config_mapping",
    "transformers.integrations.gguf.gguf_conversion_mapping",
    "transformers.integrations.gguf.gguf_tokenizer_mapping",
    "transformers.integrations.gguf.kernels",
    "transformers.integrations.gguf.reader",
    "transformers.integrations.gguf.utils",
    "transformers.integrations.sdpa_attention",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
)
#: Distributions whose metadata transformers reads at run time (``importlib.metadata``
#: version checks) and that its PyInstaller hook does not copy: without it, loading a
#: GGUF fails with "Invalid version: 'N/A'".
COPY_METADATA = ("gguf",)
#: Per family, the modules transformers imports by name (those that exist are kept).
FAMILY_MODULE_KINDS = ("configuration", "modeling", "tokenization", "tokenization_fast")

#: Paths inside the bundle (``dest`` names, POSIX separators) that are never loaded.
DROP_PATTERNS = (
    "torch/bin/*",            # C++ test binaries and protoc (torch_shm_manager is kept, below)
    "torch/test/*",           # C++ unit-test binaries
    "torch/include/*",        # C/C++ headers
    "torch/share/*",          # CMake files
    "torch/lib/*test*",       # libtorchbind_test, libjitbackend_test
    "torch/lib/libaoti_custom_ops*",
    "torch/lib/libbackend_with_compiler*",
    "torch/_inductor/codegen/*.h",
    "**/__pycache__/*",
    "libcudart*",             # a CUDA runtime found on the build machine; torch's CPU build never loads it
    # Qt's GTK3 theme plugin and the GTK stack it pulled in: it would load the system's
    # GTK against these copies (a crash when versions differ); Qt's own theme is used instead.
    "PySide6/Qt/plugins/platformthemes/libqgtk3.so",
    "libgtk-3.so*", "libgdk-3.so*", "libatk-1.0.so*", "libatk-bridge-2.0.so*", "libatspi.so*",
    "libcairo.so*", "libcairo-gobject.so*", "libpango-1.0.so*", "libpangocairo-1.0.so*",
    "libpangoft2-1.0.so*", "libgdk_pixbuf-2.0.so*", "libpixman-1.so*", "libthai.so*", "libdatrie.so*",
    "libfribidi.so*", "libgraphite2.so*", "libharfbuzz.so*", "libepoxy.so*",
)
KEEP_PATTERNS = ("torch/bin/torch_shm_manager*",)

#: System libraries the frozen app loads from the system: those PyInstaller never bundles
#: (GL, EGL, DRM, xcb, wayland: they must match the system's drivers), those it leaves out
#: when the build machine lacks them (xcb-icccm, xcb-keysyms here), and those it bundles
#: from the build machine but a desktop has anyway (fontconfig, dbus, xkbcommon, ...), so a
#: build on any machine runs. Found with ``build_deb.py --system-libs`` (ldd over the bundle).
#: ``libc6 (>= ...)`` is prepended from the newest glibc symbol version the bundle uses.
DEB_DEPENDS = (
    "libegl1",
    "libgl1",
    "libdrm2",
    "libfontconfig1",
    "libfreetype6",
    "libdbus-1-3",
    "libglib2.0-0t64 | libglib2.0-0",
    "libx11-6",
    "libx11-xcb1",
    "libxkbcommon0",
    "libxkbcommon-x11-0",
    "libxcb1",
    "libxcb-cursor0",
    "libxcb-icccm4",
    "libxcb-image0",
    "libxcb-keysyms1",
    "libxcb-randr0",
    "libxcb-render-util0",
    "libxcb-shape0",
    "libxcb-shm0",
    "libxcb-sync1",
    "libxcb-xfixes0",
    "libxcb-xkb1",
    "libxrender1",
    "libwayland-client0",
    "libwayland-cursor0",
    "libwayland-egl1",
)
#: The glibc floor when the bundle is not there to measure: torch's wheels are manylinux_2_28.
DEFAULT_GLIBC = "2.28"
DEB_INSTALL_DIR = "/opt/attnchat"
DEB_MAINTAINER = "attnchat maintainers <maintainers@users.noreply.github.com>"
DEB_HOMEPAGE = "https://github.com/attnchat/attnchat"
DEB_SUMMARY = "chat with a small language model offline, and see its KV cache and attention"
DEB_DESCRIPTION = (
    "attnchat runs a small language model on your computer, with its own decoder,\n"
    "attention and KV cache, and shows what other chat apps hide: how much memory\n"
    "the KV cache takes as the conversation grows, and where attention looks.\n"
    "The default model, SmolLM2-135M-Instruct (Apache-2.0), is included, so the\n"
    "first run needs no network."
)


def version() -> str:
    """The project's version, from ``pyproject.toml``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def machine() -> str:
    """The CPU architecture as the tarball names it: ``x86_64``, ``aarch64``."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def deb_arch() -> str:
    """The CPU architecture as Debian names it: ``amd64``, ``arm64``."""
    return {"x86_64": "amd64", "aarch64": "arm64", "i686": "i386", "armv7l": "armhf"}.get(machine(), machine())


def deb_name(ver: str | None = None, arch: str | None = None) -> str:
    return f"{APP_NAME}_{ver or version()}_{arch or deb_arch()}.deb"


def tarball_name(ver: str | None = None, arch: str | None = None) -> str:
    return f"{APP_NAME}-{ver or version()}-linux-{arch or machine()}.tar.gz"


def _transformers_root() -> Path | None:
    """transformers' package folder, found without importing it (None if not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def kept_transformers_families() -> tuple[str, ...]:
    return TRANSFORMERS_MODELS_PLUMBING + TRANSFORMERS_FAMILIES + TRANSFORMERS_GGUF_TOKENIZER_FAMILIES


def transformers_excludes(root: Path | None = None) -> list[str]:
    """Module names to exclude: every family under transformers/models but the kept ones,
    and the top-level modules in :data:`TRANSFORMERS_TOP_LEVEL_EXCLUDES`."""
    root = root or _transformers_root()
    out = [f"transformers.{name}" for name in TRANSFORMERS_TOP_LEVEL_EXCLUDES]
    if root is None:
        return out
    keep = set(kept_transformers_families())
    for child in sorted((root / "models").iterdir()):
        if child.is_dir() and (child / "__init__.py").is_file() and child.name not in keep:
            out.append(f"transformers.models.{child.name}")
    return out


def transformers_hidden_imports(root: Path | None = None) -> list[str]:
    """The modules transformers imports by name that attnchat needs (those installed)."""
    root = root or _transformers_root()
    out = list(TRANSFORMERS_HIDDEN_IMPORTS)
    for family in TRANSFORMERS_FAMILIES + TRANSFORMERS_GGUF_TOKENIZER_FAMILIES:
        for kind in FAMILY_MODULE_KINDS:
            name = f"{kind}_{family}"
            if root is None or (root / "models" / family / f"{name}.py").is_file():
                out.append(f"transformers.models.{family}.{name}")
    return out


def hidden_imports(root: Path | None = None) -> list[str]:
    return list(APP_HIDDEN_IMPORTS) + transformers_hidden_imports(root) + (["ggml", "ggml.ggml"] if _has_ggml() else [])


def _has_ggml() -> bool:
    import importlib.util

    return importlib.util.find_spec("ggml") is not None


def ggml_binaries(collect_dynamic_libs) -> list[tuple[str, str]]:
    """ggml-python's shared libraries (``ggml/lib/*.so``), which it opens by path and
    PyInstaller's analysis cannot see: the quantized GGUF kernels. None when the
    build machine has no ggml-python (the app then runs torch's kernels and says so).
    ``collect_dynamic_libs``: PyInstaller's hook helper (the spec passes it)."""
    return collect_dynamic_libs("ggml") if _has_ggml() else []


def excludes(root: Path | None = None) -> list[str]:
    return list(EXCLUDES) + transformers_excludes(root)


def drop_from_bundle(dest: str) -> bool:
    """True for a bundle path (``dest`` of a TOC entry) that is never loaded at run time."""
    d = dest.replace(os.sep, "/").replace("\\", "/")
    if any(fnmatch.fnmatch(d, p) for p in KEEP_PATTERNS):
        return False
    return any(fnmatch.fnmatch(d, p) for p in DROP_PATTERNS)


def control_fields(installed_size_kib: int, ver: str | None = None, arch: str | None = None,
                   glibc: str = DEFAULT_GLIBC) -> dict[str, str]:
    """The .deb's control fields, in the order dpkg writes them; ``glibc``: the newest
    glibc symbol version the bundle needs (``libc6 (>= glibc)``)."""
    return {
        "Package": APP_NAME,
        "Version": ver or version(),
        "Section": "utils",
        "Priority": "optional",
        "Architecture": arch or deb_arch(),
        "Maintainer": DEB_MAINTAINER,
        "Installed-Size": str(int(installed_size_kib)),
        "Depends": ", ".join((f"libc6 (>= {glibc})",) + DEB_DEPENDS),
        "Homepage": DEB_HOMEPAGE,
        "Description": DEB_SUMMARY,
    }


def render_control(fields: dict[str, str]) -> str:
    """The control file's text: ``Field: value`` lines, the long description indented by one
    space with blank lines as `` .`` (Debian Policy 5.6.13)."""
    lines = [f"{k}: {v}" for k, v in fields.items()]
    for para in DEB_DESCRIPTION.splitlines():
        lines.append(" " + para if para.strip() else " .")
    return "\n".join(lines) + "\n"


_PKG_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
_VER_RE = re.compile(r"^(\d+:)?[0-9][A-Za-z0-9.+~-]*$")
_DEP_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(:[a-z0-9]+)?( \((<<|<=|=|>=|>>) [0-9][A-Za-z0-9.+~:-]*\))?$")


def validate_control(text: str) -> list[str]:
    """Problems with a rendered control file (empty when it is well-formed)."""
    problems: list[str] = []
    if not text.endswith("\n"):
        problems.append("the control file must end with a newline")
    fields: dict[str, str] = {}
    last = None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            problems.append(f"line {n}: blank line inside the paragraph")
        elif line[0] in " \t":
            if last != "Description":
                problems.append(f"line {n}: continuation line outside Description")
        else:
            key, sep, value = line.partition(":")
            if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", key):
                problems.append(f"line {n}: not a 'Field: value' line: {line!r}")
                continue
            if key in fields:
                problems.append(f"line {n}: duplicate field {key}")
            fields[key], last = value.strip(), key
    for key in ("Package", "Version", "Architecture", "Maintainer", "Description"):
        if not fields.get(key):
            problems.append(f"missing required field {key}")
    if fields.get("Package") and not _PKG_RE.match(fields["Package"]):
        problems.append(f"bad package name {fields['Package']!r}")
    if fields.get("Version") and not _VER_RE.match(fields["Version"]):
        problems.append(f"bad version {fields['Version']!r}")
    if fields.get("Architecture") and not re.fullmatch(r"[a-z0-9-]+", fields["Architecture"]):
        problems.append(f"bad architecture {fields['Architecture']!r}")
    if fields.get("Maintainer") and not re.fullmatch(r"[^<>]+ <[^<>@\s]+@[^<>\s]+>", fields["Maintainer"]):
        problems.append(f"Maintainer must be 'Name <email>': {fields['Maintainer']!r}")
    if "Installed-Size" in fields and not fields["Installed-Size"].isdigit():
        problems.append("Installed-Size must be a whole number of KiB")
    for dep in (d.strip() for d in fields.get("Depends", "").split(",")):
        for alt in (a.strip() for a in dep.split("|")):
            if not _DEP_RE.match(alt):
                problems.append(f"bad dependency {alt!r}")
    return problems
