"""Checks made before the QApplication exists: Qt aborts the process (SIGABRT, exit 134,
nothing on the terminal) when its platform plugin cannot start, so what we can see
beforehand we say in one line and exit 2.

Linux only (elsewhere Qt's platform plugins are part of the system). Imports no Qt
module: it only looks at PySide6's plugin folder, runs ``ldd`` on the X11 plugin (the
look-up ``packaging/build_deb.py --system-libs`` makes for the .deb's Depends) and
tries the X server's socket.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping

__all__ = ["platform_problem", "debian_package", "missing_libraries", "x_server_answers"]

WAY_OUT = "or run `attnchat --terminal` to chat in the terminal"


def plugins_dir() -> Path | None:
    """PySide6's ``Qt/plugins/platforms`` folder, or None when it is not where a wheel puts it."""
    spec = importlib.util.find_spec("PySide6")
    for base in (spec.submodule_search_locations or []) if spec else []:
        d = Path(base) / "Qt" / "plugins" / "platforms"
        if d.is_dir():
            return d
    return None


def debian_package(soname: str) -> str:
    """A shared library's Debian package by the policy's naming (``libxcb-icccm.so.4`` ->
    ``libxcb-icccm4``, ``libxkbcommon-x11.so.0`` -> ``libxkbcommon-x11-0``)."""
    m = re.match(r"(.+?)\.so\.(\d+)", soname)
    if not m:
        return soname
    name, version = m.group(1).lower(), m.group(2)
    return f"{name}{'-' if name[-1].isdigit() else ''}{version}"


def missing_libraries(plugin: Path, ldd: Callable[[Path], str] | None = None) -> list[str]:
    """Sonames ``plugin`` needs that the dynamic loader cannot find (``ldd``'s "not found")."""
    if ldd is None:
        if shutil.which("ldd") is None:
            return []
        ldd = lambda p: subprocess.run(["ldd", str(p)], capture_output=True, text=True, timeout=10).stdout  # noqa: E731
    out = []
    for line in ldd(plugin).splitlines():
        name, arrow, where = line.strip().partition(" => ")
        if arrow and where.strip().startswith("not found"):
            if name.strip() not in out:
                out.append(name.strip())
    return out


def x_server_answers(display: str, socket_dir: Path = Path("/tmp/.X11-unix"), timeout: float = 1.0) -> bool:
    """Whether an X server accepts a connection at ``display`` (``:0``, ``:99.0``, ``host:1``)."""
    m = re.fullmatch(r"(?:unix)?(?P<host>[^:]*):(?P<n>\d+)(?:\.\d+)?", display.strip())
    if not m:
        return False
    n, host = int(m.group("n")), m.group("host")
    try:
        if host and host != "unix":
            with socket.create_connection((host, 6000 + n), timeout=timeout):
                return True
        for address in (str(socket_dir / f"X{n}"), f"\0{socket_dir}/X{n}"):   # a file, then Linux's abstract name
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(timeout)
                try:
                    s.connect(address)
                    return True
                except OSError:
                    continue
    except OSError:
        return False
    return False


def platform_problem(env: Mapping[str, str] | None = None, *, plugins: Path | None = None,
                     ldd: Callable[[Path], str] | None = None, socket_dir: Path = Path("/tmp/.X11-unix"),
                     platform: str = sys.platform, window: bool = True) -> str | None:
    """One line saying why Qt's platform plugin will not start, or None (start it).

    Looks at ``QT_QPA_PLATFORM`` (a plugin that does not exist), and for X11 (the plugin
    Qt picks with ``DISPLAY`` and no Wayland): its libraries, and whether ``DISPLAY`` has
    a server. ``window=False`` (the headless runs, offscreen): the plugin name only.
    """
    env = os.environ if env is None else env
    if not platform.startswith("linux"):
        return None
    plugins = plugins or plugins_dir()
    if plugins is None:
        return None
    have = sorted(p.name[len("libq"):-len(".so")] for p in plugins.glob("libq*.so"))
    chosen = env.get("QT_QPA_PLATFORM", "").strip()
    names = [c.split(":")[0].strip() for c in chosen.split(";") if c.strip()]
    if names and not any(n in have for n in names):
        return (f"Qt has no platform plugin {chosen!r} (QT_QPA_PLATFORM); use one of {', '.join(have)}, "
                f"unset it, {WAY_OUT}")
    first = next((n for n in names if n in have), "")
    x11 = first == "xcb" or (not first and env.get("DISPLAY") and not env.get("WAYLAND_DISPLAY"))
    if not x11 or not window:
        return None
    lost = missing_libraries(plugins / "libqxcb.so", ldd) if (plugins / "libqxcb.so").exists() else []
    if lost:
        pkgs = " ".join(sorted({debian_package(s) for s in lost}))
        return (f"Qt's X11 plugin cannot load: {', '.join(lost)} not found; install them "
                f"(Debian/Ubuntu: sudo apt-get install {pkgs}), {WAY_OUT}")
    display = env.get("DISPLAY", "")
    if display and not x_server_answers(display, socket_dir):
        return f"no X server answers at DISPLAY={display}; start one or set DISPLAY to a running one, {WAY_OUT}"
    return None
