"""Draw attnchat's icon and write it as PNG (Linux), ICO (Windows) and ICNS (macOS).

Run by hand when the design changes (the files are committed; builds do not run it)::

    QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/make_icon.py

The picture: a speech bubble holding a causal attention pattern (a lower-triangular
grid, brighter on the diagonal). ICO and ICNS entries are PNG-compressed, which
Windows Vista+ and macOS 10.7+ read, so only Qt's PNG writer is needed.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def render(size: int) -> bytes:
    """The icon as PNG bytes, ``size`` x ``size`` pixels."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QPointF, QRectF, Qt
    from PySide6.QtGui import QBrush, QColor, QImage, QLinearGradient, QPainter, QPainterPath

    img = QImage(size, size, QImage.Format.Format_ARGB32)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    s = size / 256.0
    grad = QLinearGradient(QPointF(0, 0), QPointF(0, size))
    grad.setColorAt(0.0, QColor("#4f8df7"))
    grad.setColorAt(1.0, QColor("#2b5fc4"))
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QBrush(grad))
    p.drawRoundedRect(QRectF(8 * s, 8 * s, 240 * s, 240 * s), 48 * s, 48 * s)
    bubble = QPainterPath()
    bubble.addRoundedRect(QRectF(40 * s, 44 * s, 176 * s, 140 * s), 28 * s, 28 * s)
    tail = QPainterPath()
    tail.moveTo(78 * s, 176 * s)
    tail.lineTo(62 * s, 214 * s)
    tail.lineTo(112 * s, 180 * s)
    tail.closeSubpath()
    p.setBrush(QColor("#ffffff"))
    p.drawPath(bubble.united(tail))
    n, cell, gap = 4, 24 * s, 6 * s
    x0 = 128 * s - (n * cell + (n - 1) * gap) / 2
    y0 = 114 * s - (n * cell + (n - 1) * gap) / 2
    for i in range(n):
        for j in range(i + 1):  # causal: query i sees keys <= i
            alpha = 255 if i == j else 90 + 40 * j
            p.setBrush(QColor(43, 95, 196, alpha))
            p.drawRoundedRect(QRectF(x0 + j * (cell + gap), y0 + i * (cell + gap), cell, cell), 4 * s, 4 * s)
    p.end()
    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    img.save(buf, "PNG")
    buf.close()
    return bytes(data.data())


def ico(pngs: dict[int, bytes]) -> bytes:
    """An ICO file holding PNG images (ICONDIR, ICONDIRENTRY per image, then the data)."""
    header = struct.pack("<HHH", 0, 1, len(pngs))
    offset = 6 + 16 * len(pngs)
    entries, blobs = b"", b""
    for size, data in sorted(pngs.items()):
        dim = 0 if size >= 256 else size  # 0 means 256
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(data), offset + len(blobs))
        blobs += data
    return header + entries + blobs


ICNS_TYPES = {128: b"ic07", 256: b"ic08", 512: b"ic09"}


def icns(pngs: dict[int, bytes]) -> bytes:
    """An ICNS file holding PNG images ('icns', total length, then type/length/data per image)."""
    body = b"".join(ICNS_TYPES[size] + struct.pack(">I", 8 + len(data)) + data
                    for size, data in sorted(pngs.items()) if size in ICNS_TYPES)
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def main() -> int:
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])  # noqa: F841 (fonts, image I/O)
    pngs = {size: render(size) for size in (16, 32, 48, 128, 256, 512)}
    (HERE / "attnchat.png").write_bytes(pngs[256])
    (HERE / "attnchat.ico").write_bytes(ico({k: v for k, v in pngs.items() if k <= 256 and k != 128}))
    (HERE / "attnchat.icns").write_bytes(icns(pngs))
    print("wrote attnchat.png, attnchat.ico, attnchat.icns in", HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
