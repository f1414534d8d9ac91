"""Build the Linux artifacts from PyInstaller's one-folder app: a .deb and a tarball.

    python packaging/build_deb.py              # dist/attnchat/ -> dist/attnchat_<ver>_<arch>.deb
                                               #                  + dist/attnchat-<ver>-linux-<arch>.tar.gz
    python packaging/build_deb.py --dry-run    # print the control file and the layout, check them, build nothing

The .deb installs the app to /opt/attnchat, a launcher to /usr/bin/attnchat, the
.desktop file and a 256 px icon; its control data comes from packaging/bundle.py.
It is built with ``dpkg-deb --root-owner-group`` (no fakeroot needed). Stdlib only;
``make package`` runs it after PyInstaller. Exit status 0, or 1 with the problem on stderr.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import mmap
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def _load_bundle():
    spec = importlib.util.spec_from_file_location("attnchat_bundle", Path(__file__).resolve().parent / "bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


B = _load_bundle()

LAUNCHER = f'#!/bin/sh\n# attnchat is installed in {B.DEB_INSTALL_DIR}; this starts it.\nexec {B.DEB_INSTALL_DIR}/attnchat "$@"\n'
COPYRIGHT = """\
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: attnchat
Source: {homepage}

Files: *
Copyright: attnchat maintainers
License: Apache-2.0

Files: opt/attnchat/_internal/bundled_models/*
Copyright: Hugging Face (SmolLM2-135M-Instruct, GGUF Q4_1)
License: Apache-2.0

Comment: {install}/_internal also holds Python and the libraries attnchat runs on
 (PyTorch, transformers, tokenizers, Qt for Python, NumPy and others), each under
 its own licence; their licence files sit in the *.dist-info folders beside them.

License: Apache-2.0
 On Debian systems the full text is in /usr/share/common-licenses/Apache-2.0.
"""


@dataclass(frozen=True)
class Entry:
    """One path in the package: copied from ``source`` (a file or a whole folder) or written from ``text``."""

    dest: str                 # path inside the package, no leading slash
    source: Path | None = None
    text: str | None = None
    mode: int = 0o644


def layout(app_dir: Path) -> list[Entry]:
    """What the .deb holds (DEBIAN/ aside)."""
    install = B.DEB_INSTALL_DIR.strip("/")
    return [
        Entry(install, source=app_dir, mode=0o755),
        Entry("usr/bin/attnchat", text=LAUNCHER, mode=0o755),
        Entry("usr/share/applications/attnchat.desktop", source=B.DESKTOP_FILE),
        Entry("usr/share/icons/hicolor/256x256/apps/attnchat.png", source=B.ICON_PNG),
        Entry("usr/share/doc/attnchat/copyright",
              text=COPYRIGHT.format(homepage=B.DEB_HOMEPAGE, install=B.DEB_INSTALL_DIR)),
    ]


def _kib(size: int) -> int:
    return (size + 1023) // 1024


def installed_size_kib(entries: list[Entry]) -> int:
    """Installed-Size as dpkg counts it: KiB per file, rounded up (0 for a missing app folder)."""
    total = 0
    for e in entries:
        if e.text is not None:
            total += _kib(len(e.text.encode()))
        elif e.source is not None and e.source.is_dir():
            total += sum(_kib(p.lstat().st_size) for p in e.source.rglob("*") if p.is_file() or p.is_symlink())
        elif e.source is not None and e.source.exists():
            total += _kib(e.source.stat().st_size)
    return total


def _elf_files(app_dir: Path):
    for p in sorted(app_dir.rglob("*")):
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                if f.read(4) == b"\x7fELF":
                    yield p


def glibc_floor(app_dir: Path) -> str:
    """The newest ``GLIBC_2.x`` symbol version any ELF file in the app needs (``libc6 (>= it)``)."""
    best = tuple(int(x) for x in B.DEFAULT_GLIBC.split("."))
    for p in _elf_files(app_dir):
        if p.stat().st_size == 0:
            continue
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for match in re.finditer(rb"GLIBC_(2\.[0-9]+)(?![0-9.])", m):
                best = max(best, tuple(int(x) for x in match.group(1).split(b".")))
    return ".".join(map(str, best))


def system_libs(app_dir: Path) -> dict[str, str]:
    """Shared libraries the app's ELF files load from outside the app: soname -> path, or
    "not found" (ldd with the app's folders first on the search path, as the bootloader does)."""
    elves = list(_elf_files(app_dir))
    search = ":".join(sorted({str(p.parent) for p in elves}))
    found: dict[str, str] = {}
    for p in elves:
        r = subprocess.run(["ldd", str(p)], capture_output=True, text=True, env={**os.environ, "LD_LIBRARY_PATH": search})
        for line in r.stdout.splitlines():
            name, arrow, where = line.strip().partition(" => ")
            if not arrow:
                continue
            where = where.split(" (")[0].strip()
            if not where.startswith(str(app_dir)):
                found.setdefault(name, where)
    return dict(sorted(found.items()))


def print_system_libs(app_dir: Path) -> int:
    """``--system-libs``: each library from outside the app, with its Debian package (dpkg -S)."""
    for name, where in system_libs(app_dir).items():
        package = "?"
        if where != "not found" and shutil.which("dpkg"):
            for candidate in (where, os.path.realpath(where)):  # merged /usr: dpkg knows one of them
                r = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
                if r.returncode == 0:
                    package = r.stdout.split(":")[0]
                    break
        print(f"{name:32} {package:24} {where}")
    return 0


def _stage(entries: list[Entry], root: Path) -> None:
    for e in entries:
        dest = root / e.dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        if e.text is not None:
            dest.write_text(e.text)
        elif e.source.is_dir():
            # Hard links where the file system allows: the app is ~1 GB.
            def link_or_copy(src, dst):
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)
            shutil.copytree(e.source, dest, symlinks=True, copy_function=link_or_copy)
        else:
            shutil.copyfile(e.source, dest)
        if not dest.is_dir():
            os.chmod(dest, e.mode)
    for d in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
        os.chmod(d, 0o755)


def _md5sums(root: Path) -> str:
    lines = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.relative_to(root).parts[0] != "DEBIAN":
            digest = hashlib.md5()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            lines.append(f"{digest.hexdigest()}  {p.relative_to(root).as_posix()}")
    return "\n".join(lines) + "\n"


def build_deb(app_dir: Path, out: Path, compression: str) -> Path:
    """Stage the package in a temp folder and run dpkg-deb; returns the .deb's path."""
    if shutil.which("dpkg-deb") is None:
        raise SystemExit("build_deb: dpkg-deb not found; install dpkg (Debian, Ubuntu) or pass --no-deb")
    entries = layout(app_dir)
    control = B.render_control(B.control_fields(installed_size_kib(entries), glibc=glibc_floor(app_dir)))
    problems = B.validate_control(control)
    if problems:
        raise SystemExit("build_deb: bad control file: " + "; ".join(problems))
    target = out / B.deb_name()
    with tempfile.TemporaryDirectory(prefix="attnchat-deb-", dir=out) as tmp:
        root = Path(tmp) / "root"
        _stage(entries, root)
        (root / "DEBIAN").mkdir(mode=0o755)
        (root / "DEBIAN" / "control").write_text(control)
        (root / "DEBIAN" / "md5sums").write_text(_md5sums(root))
        subprocess.run(["dpkg-deb", "--root-owner-group", f"-Z{compression}", "--build", str(root), str(target)],
                       check=True, stdout=subprocess.DEVNULL)
    return target


def build_tarball(app_dir: Path, out: Path) -> Path:
    """``attnchat-<ver>-linux-<arch>/`` holding the app folder's contents, the .desktop file and the icon."""
    target = out / B.tarball_name()
    top = target.name.removesuffix(".tar.gz")

    def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    tmp = target.with_name(target.name + ".part")
    with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
        tar.add(app_dir, arcname=top, filter=owned_by_root)
        tar.add(B.DESKTOP_FILE, arcname=f"{top}/share/applications/attnchat.desktop", filter=owned_by_root)
        tar.add(B.ICON_PNG, arcname=f"{top}/share/icons/hicolor/256x256/apps/attnchat.png", filter=owned_by_root)
    os.replace(tmp, target)
    return target


def dry_run(app_dir: Path) -> int:
    """Print the control file and the layout, and check them; builds nothing."""
    entries = layout(app_dir)
    size = installed_size_kib(entries)
    glibc = glibc_floor(app_dir) if app_dir.is_dir() else B.DEFAULT_GLIBC
    control = B.render_control(B.control_fields(size, glibc=glibc))
    print(f"# {B.deb_name()}: DEBIAN/control")
    print(control, end="")
    print(f"# layout ({'app folder ' + str(app_dir) if app_dir.is_dir() else 'no app folder yet: Installed-Size counts the rest'})")
    for e in entries:
        what = "generated" if e.text is not None else str(e.source)
        print(f"/{e.dest}  ({oct(e.mode)}, {what})")
    print(f"# and {B.tarball_name()}")
    problems = B.validate_control(control)
    problems += [f"missing {e.source}" for e in entries if e.source is not None and e.source != app_dir and not e.source.exists()]
    for p in problems:
        print(f"build_deb: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app-dir", type=Path, default=B.APP_DIR, help="PyInstaller's one-folder app (default dist/attnchat)")
    parser.add_argument("--out", type=Path, default=B.DIST_DIR, help="where the artifacts go (default dist/)")
    parser.add_argument("--dry-run", action="store_true", help="print the control file and the layout; build nothing")
    parser.add_argument("--system-libs", action="store_true",
                        help="list the libraries the app loads from the system, with their packages (for Depends)")
    parser.add_argument("--no-deb", action="store_true", help="only the tarball")
    parser.add_argument("--no-tarball", action="store_true", help="only the .deb")
    parser.add_argument("--compression", default="xz", choices=["xz", "gzip", "zstd", "none"], help="the .deb's compression (default xz)")
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run(args.app_dir)
    if args.system_libs:
        return print_system_libs(args.app_dir)
    if not (args.app_dir / "attnchat").is_file():
        print(f"build_deb: {args.app_dir}/attnchat not found; run PyInstaller first (make package)", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for wanted, build in ((not args.no_deb, lambda: build_deb(args.app_dir, args.out, args.compression)),
                          (not args.no_tarball, lambda: build_tarball(args.app_dir, args.out))):
        if wanted:
            t0 = time.perf_counter()
            path = build()
            print(f"built {path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
