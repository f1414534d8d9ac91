"""The .deb's control data and layout, and the builder on a stand-in app (no PyInstaller)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from .conftest import ROOT

QT_SYSTEM_LIBS = ("libegl1", "libxkbcommon-x11-0", "libxcb-cursor0", "libfontconfig1")


def _fields(text: str) -> dict[str, str]:
    return {ln.split(":", 1)[0]: ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln and ln[0] != " "}


def test_control_file_is_well_formed(bundle):
    text = bundle.render_control(bundle.control_fields(123456))
    assert bundle.validate_control(text) == []
    f = _fields(text)
    assert f["Package"] == "attnchat"
    assert f["Version"] == bundle.version()
    assert f["Architecture"] == bundle.deb_arch()
    assert f["Installed-Size"] == "123456"
    assert len(f["Description"]) <= 80 and not f["Description"].lower().startswith("attnchat")
    depends = [d.split(" ")[0] for d in f["Depends"].split(", ")]
    for lib in QT_SYSTEM_LIBS:
        assert lib in depends


def test_version_comes_from_pyproject(bundle):
    text = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{bundle.version()}"' in text


@pytest.mark.parametrize("broken, problem", [
    ("Package: Attnchat_App\n", "bad package name"),
    ("Version: one\n", "bad version"),
    ("Maintainer: nobody\n", "Maintainer"),
    ("Depends: libegl1, lib egl\n", "bad dependency"),
    ("Installed-Size: 1.5\n", "Installed-Size"),
])
def test_validate_control_finds_problems(bundle, broken, problem):
    good = bundle.render_control(bundle.control_fields(1))
    key = broken.split(":")[0]
    text = re.sub(rf"^{key}: .*\n", broken, good, flags=re.M)
    assert any(problem in p for p in bundle.validate_control(text))


def test_validate_control_finds_structure_problems(bundle):
    good = bundle.render_control(bundle.control_fields(1))
    assert any("blank line" in p for p in bundle.validate_control(good.replace("\n ", "\n\n ", 1)))
    assert any("missing required field Architecture" in p
               for p in bundle.validate_control(re.sub(r"^Architecture: .*\n", "", good, flags=re.M)))


def test_artifact_names(bundle):
    assert bundle.deb_name("0.1.0", "amd64") == "attnchat_0.1.0_amd64.deb"
    assert bundle.tarball_name("0.1.0", "x86_64") == "attnchat-0.1.0-linux-x86_64.tar.gz"
    assert re.fullmatch(r"attnchat_[0-9][^_]*_[a-z0-9]+\.deb", bundle.deb_name())


def test_dry_run_prints_control_and_layout(builder, fake_app, capsys):
    assert builder.main(["--dry-run", "--app-dir", str(fake_app)]) == 0
    out = capsys.readouterr().out
    assert "Package: attnchat" in out
    for path in ("/opt/attnchat ", "/usr/bin/attnchat ", "/usr/share/applications/attnchat.desktop",
                 "/usr/share/icons/hicolor/256x256/apps/attnchat.png", "/usr/share/doc/attnchat/copyright"):
        assert path in out


def test_dry_run_works_before_pyinstaller(builder, tmp_path, capsys):
    assert builder.main(["--dry-run", "--app-dir", str(tmp_path / "missing")]) == 0
    assert "no app folder yet" in capsys.readouterr().out


def test_build_without_app_folder_says_what_to_do(builder, tmp_path, capsys):
    assert builder.main(["--app-dir", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 1
    assert "make package" in capsys.readouterr().err


def test_launcher_runs_the_installed_app(builder, bundle):
    assert builder.LAUNCHER.startswith("#!/bin/sh\n")
    assert f'exec {bundle.DEB_INSTALL_DIR}/attnchat "$@"' in builder.LAUNCHER


def test_installed_size_counts_kib_per_file(builder, fake_app):
    entries = [e for e in builder.layout(fake_app) if e.source == fake_app]
    # attnchat (1 KiB), libfake.so (3000 B -> 3 KiB), model.gguf (1 KiB)
    assert builder.installed_size_kib(entries) == 5


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_build_deb_on_a_stand_in_app(builder, bundle, fake_app, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    deb = builder.build_deb(fake_app, out, "gzip")
    assert deb.name == bundle.deb_name()
    info = subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True).stdout
    assert bundle.validate_control(info) == []
    listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True, check=True).stdout
    rows = {ln.split()[-1].lstrip("."): ln.split()[0] for ln in listing.splitlines()}
    assert rows["/opt/attnchat/attnchat"].startswith("-rwxr-xr-x")
    assert rows["/usr/bin/attnchat"].startswith("-rwxr-xr-x")
    for path in ("/opt/attnchat/_internal/bundled_models/model.gguf", "/usr/share/applications/attnchat.desktop",
                 "/usr/share/icons/hicolor/256x256/apps/attnchat.png", "/usr/share/doc/attnchat/copyright"):
        assert path in rows
    assert all(" root/root " in ln for ln in listing.splitlines())
    assert [p.name for p in out.iterdir()] == [deb.name]  # the staging folder is gone


@pytest.mark.skipif(sys.platform == "win32", reason="a Linux tarball keeps POSIX modes, which Windows has not")
def test_build_tarball_on_a_stand_in_app(builder, bundle, fake_app, tmp_path):
    tarball = builder.build_tarball(fake_app, tmp_path)
    assert tarball.name == bundle.tarball_name()
    top = tarball.name.removesuffix(".tar.gz")
    with tarfile.open(tarball) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members[f"{top}/attnchat"].mode & 0o111
    assert f"{top}/_internal/bundled_models/model.gguf" in members
    assert f"{top}/share/applications/attnchat.desktop" in members
    assert all(m.uid == 0 and m.uname == "root" for m in members.values())


def test_glibc_floor_reads_symbol_versions(builder, bundle, fake_app):
    assert builder.glibc_floor(fake_app) == bundle.DEFAULT_GLIBC  # no ELF files: torch's manylinux floor
    (fake_app / "_internal" / "liba.so").write_bytes(b"\x7fELF" + b"\0GLIBC_2.17\0GLIBC_2.34\0GLIBC_PRIVATE\0")
    (fake_app / "_internal" / "notes.txt").write_bytes(b"GLIBC_2.99")  # not an ELF file: ignored
    assert builder.glibc_floor(fake_app) == "2.34"
    fields = bundle.control_fields(1, glibc="2.34")
    assert fields["Depends"].startswith("libc6 (>= 2.34), ")
