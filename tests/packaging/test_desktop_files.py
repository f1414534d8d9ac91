"""The .desktop entry, the icons and the NSIS script (compiled when makensis is installed)."""
from __future__ import annotations

import configparser
import re
import shutil
import struct
import subprocess

import pytest

from .conftest import PACKAGING
from tests.hang import HANG_S

NSI = PACKAGING / "attnchat.nsi"


def _desktop_entry() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string((PACKAGING / "attnchat.desktop").read_text())
    return parser["Desktop Entry"]


def test_desktop_entry_fields():
    entry = _desktop_entry()
    assert entry["Type"] == "Application"
    assert entry["Name"] == "attnchat"
    assert entry["Exec"].split()[0] == "attnchat"  # /usr/bin/attnchat, the .deb's launcher
    assert entry["Icon"] == "attnchat"              # hicolor/256x256/apps/attnchat.png
    assert entry["Terminal"] == "false"
    assert entry["StartupWMClass"] == "attnchat"     # desktop.app: setDesktopFileName("attnchat")
    assert entry["Categories"].endswith(";")


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None, reason="desktop-file-utils not installed")
def test_desktop_file_validate():
    r = subprocess.run(["desktop-file-validate", str(PACKAGING / "attnchat.desktop")], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_png_icon_is_256px():
    data = (PACKAGING / "attnchat.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (256, 256)


def test_ico_and_icns_hold_pngs():
    ico = (PACKAGING / "attnchat.ico").read_bytes()
    reserved, kind, count = struct.unpack("<HHH", ico[:6])
    assert (reserved, kind) == (0, 1) and count >= 1
    sizes = [ico[6 + 16 * i] or 256 for i in range(count)]
    assert 256 in sizes and 16 in sizes
    icns = (PACKAGING / "attnchat.icns").read_bytes()
    assert icns[:4] == b"icns" and struct.unpack(">I", icns[4:8])[0] == len(icns)
    assert b"ic08" in icns  # 256 px


def test_nsis_script_references_the_app():
    text = NSI.read_text()
    assert re.search(r'!define SRCDIR "\.\.\\dist\\attnchat"', text)  # PyInstaller's one folder
    assert 'File /r "${SRCDIR}\\*.*"' in text
    assert "$INSTDIR\\attnchat.exe" in text          # the spec's windowed exe on Windows
    assert "$INSTDIR\\attnchat-cli.exe" in text      # and its console exe
    assert 'RMDir /r "$INSTDIR\\_internal"' in text
    assert "WriteUninstaller" in text and "$PROGRAMFILES64" in text
    for icon in re.findall(r'MUI_(?:UN)?ICON "([^"]+)"', text):
        assert (PACKAGING / icon).is_file()


@pytest.mark.skipif(shutil.which("makensis") is None, reason="nsis not installed")
def test_nsis_script_compiles(tmp_path):
    app = tmp_path / "attnchat"
    (app / "_internal").mkdir(parents=True)
    for name in ("attnchat.exe", "attnchat-cli.exe", "_internal/python311.dll"):
        (app / name).write_bytes(b"stand-in")
    out = tmp_path / "attnchat-installer-check.exe"
    r = subprocess.run(["makensis", "-V2", "-WX", "-DVERSION=0.1.0", f"-DSRCDIR={app}", f"-DOUTFILE={out}", str(NSI)],
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert out.read_bytes()[:2] == b"MZ"


def test_workflow_builds_on_windows_and_macos():
    import yaml

    wf = yaml.safe_load((PACKAGING.parent / ".github" / "workflows" / "package.yml").read_text())
    job = wf["jobs"]["package"]
    oses = job["strategy"]["matrix"]["os"]
    assert any(o.startswith("windows") for o in oses) and any(o.startswith("macos") for o in oses)
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    assert "packaging/attnchat.spec" in runs
    assert "packaging/requirements-package.txt" in runs
    assert "makensis" in runs and "packaging\\attnchat.nsi" in runs
    assert "--self-test" in runs
