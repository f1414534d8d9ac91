"""What would make Qt abort is said in one line before the QApplication exists (exit 2)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from desktop.qt_preflight import debian_package, missing_libraries, platform_problem, x_server_answers
from tests.hang import HANG_S

LDD_MISSING = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibxcb-icccm.so.4 => not found
\tlibxcb.so.1 => /lib/x86_64-linux-gnu/libxcb.so.1 (0x00007f)
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
"""


@pytest.fixture
def plugins(tmp_path):
    d = tmp_path / "platforms"
    d.mkdir()
    for name in ("xcb", "offscreen", "wayland"):
        (d / f"libq{name}.so").write_bytes(b"")
    return d


def test_debian_package_names():
    assert debian_package("libxcb-icccm.so.4") == "libxcb-icccm4"
    assert debian_package("libxcb-keysyms.so.1") == "libxcb-keysyms1"
    assert debian_package("libxkbcommon-x11.so.0") == "libxkbcommon-x11-0"
    assert debian_package("libX11-xcb.so.1") == "libx11-xcb1"


def test_missing_libraries_from_ldd(plugins):
    assert missing_libraries(plugins / "libqxcb.so", lambda p: LDD_MISSING) == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]


def test_an_unknown_platform_plugin(plugins):
    line = platform_problem({"QT_QPA_PLATFORM": "bogus"}, plugins=plugins, platform="linux")
    assert "'bogus'" in line and "offscreen, wayland, xcb" in line and "attnchat --terminal" in line
    assert platform_problem({"QT_QPA_PLATFORM": "bogus;offscreen"}, plugins=plugins, platform="linux") is None
    assert platform_problem({"QT_QPA_PLATFORM": "bogus"}, plugins=plugins, platform="darwin") is None


def test_missing_xcb_libraries_name_their_packages(plugins):
    line = platform_problem({"DISPLAY": ":0"}, plugins=plugins, ldd=lambda p: LDD_MISSING, platform="linux")
    assert "libxcb-icccm.so.4, libxcb-keysyms.so.1 not found" in line
    assert "sudo apt-get install libxcb-icccm4 libxcb-keysyms1" in line and "attnchat --terminal" in line
    # Wayland is chosen over X11 when both are there; headless runs only need their plugin.
    assert platform_problem({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, plugins=plugins,
                            ldd=lambda p: LDD_MISSING, platform="linux") is None
    assert platform_problem({"DISPLAY": ":0"}, plugins=plugins, ldd=lambda p: LDD_MISSING, platform="linux",
                            window=False) is None


def test_a_display_without_a_server(plugins, tmp_path):
    sockets = tmp_path / "x11"
    sockets.mkdir()
    env = {"DISPLAY": ":71"}
    line = platform_problem(env, plugins=plugins, ldd=lambda p: "", socket_dir=sockets, platform="linux")
    assert line.startswith("no X server answers at DISPLAY=:71") and "attnchat --terminal" in line
    with socket.socket(socket.AF_UNIX) as server:   # a listening socket where the X server's would be
        server.bind(str(sockets / "X71"))
        server.listen(1)
        assert x_server_answers(":71.0", sockets)
        assert platform_problem(env, plugins=plugins, ldd=lambda p: "", socket_dir=sockets, platform="linux") is None
    assert not x_server_answers("nonsense", sockets)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Qt's platform plugins are checked on Linux")
def test_the_app_exits_2_with_one_line_instead_of_aborting(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env.update(QT_QPA_PLATFORM="bogus", HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    r = subprocess.run([sys.executable, "-m", "attnchat"], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnchat: error: Qt has no platform plugin 'bogus'")
    assert "Traceback" not in r.stderr
