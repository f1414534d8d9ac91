"""The open conversation's messages as a Qt list model, and a reply's footnote.

Each message is one row of :class:`MessageListModel`; a streaming reply grows by
:meth:`MessageListModel.append_text`, which emits ``dataChanged`` for that one row.
Must not import torch or runtime.
"""
from __future__ import annotations

from typing import Any

from PySide6.QtCore import QAbstractListModel, QModelIndex, Qt

__all__ = ["MessageListModel", "describe_finish", "duration", "reply_seed"]


def duration(seconds: float) -> str:
    """``"45 s"``, ``"2 min 05 s"``."""
    s = max(0, int(round(seconds)))
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"


def describe_finish(reason: str | None, stats: dict | None) -> str:
    """A reply's footnote: why it ended (when not naturally), its speed, and the seed of a sampled one."""
    notes = {"cancelled": "stopped", "length": "length limit", "context": "context full", "error": "failed"}
    parts = [notes[reason]] if reason in notes else []
    if stats and stats.get("completion_tokens"):
        n = int(stats["completion_tokens"])
        parts.append(f"{n:,} token{'s' if n != 1 else ''}")
        if stats.get("decode_tokens_per_s"):
            parts.append(f"{stats['decode_tokens_per_s']:.1f} tok/s")
    seed = reply_seed(stats)
    if seed is not None:
        parts.append(f"seed {seed}")
    return " · ".join(parts)


def reply_seed(stats: dict | None) -> int | None:
    """The seed a sampled reply was drawn with (its ``stats["settings"]``: ``reply_seed`` when the
    window drew it for a random-seed setting, else the ``seed`` set); None for a greedy reply or
    one whose seed was not recorded."""
    settings = (stats or {}).get("settings") or {}
    seed, temperature = settings.get("reply_seed", settings.get("seed")), settings.get("temperature")
    if seed is None or int(seed) < 0 or not temperature or float(temperature) <= 0:
        return None
    return int(seed)


class MessageListModel(QAbstractListModel):
    """The messages of the open conversation.

    Each row is a dict: ``id`` (database id or None), ``role``, ``content``,
    ``streaming`` (bool), ``finish_reason``, ``stats`` (dict), ``progress`` (the prompt's
    ``(done, total, seconds left or None)`` tokens read so far while the reply waits for its
    first text, or None),
    ``version`` and ``versions`` (the branch shown of a regenerated reply, 1-based, and how
    many it has; 0 and 0 for a reply never regenerated).
    """

    IdRole = Qt.ItemDataRole.UserRole + 1
    RoleRole = Qt.ItemDataRole.UserRole + 2
    ContentRole = Qt.ItemDataRole.UserRole + 3
    StreamingRole = Qt.ItemDataRole.UserRole + 4
    FinishRole = Qt.ItemDataRole.UserRole + 5
    StatsRole = Qt.ItemDataRole.UserRole + 6
    ProgressRole = Qt.ItemDataRole.UserRole + 7
    VersionRole = Qt.ItemDataRole.UserRole + 8
    VersionsRole = Qt.ItemDataRole.UserRole + 9

    _KEYS = {IdRole: "id", RoleRole: "role", ContentRole: "content", StreamingRole: "streaming",
             FinishRole: "finish_reason", StatsRole: "stats", ProgressRole: "progress",
             VersionRole: "version", VersionsRole: "versions"}

    def __init__(self, parent=None):
        super().__init__(parent)
        self._rows: list[dict[str, Any]] = []

    # ---- Qt model API --------------------------------------------------------------------
    def rowCount(self, parent: QModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._rows)

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        row = self._rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return row["content"]
        if role == Qt.ItemDataRole.AccessibleTextRole:
            return f"{'You' if row['role'] == 'user' else 'Assistant'}: {row['content']}"
        key = self._KEYS.get(role)
        return row.get(key) if key else None

    def roleNames(self) -> dict[int, bytes]:
        names = {r: k.encode() for r, k in self._KEYS.items()}
        names[Qt.ItemDataRole.DisplayRole] = b"display"
        return names

    def flags(self, index: QModelIndex) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemNeverHasChildren

    # ---- edits ---------------------------------------------------------------------------
    def set_messages(self, messages: list[dict[str, Any]]) -> None:
        self.beginResetModel()
        self._rows = [self._row(m) for m in messages]
        self.endResetModel()

    def append(self, role: str, content: str = "", *, id: int | None = None, streaming: bool = False,
               finish_reason: str | None = None, stats: dict | None = None) -> int:
        n = len(self._rows)
        self.beginInsertRows(QModelIndex(), n, n)
        self._rows.append(self._row(dict(id=id, role=role, content=content, streaming=streaming,
                                         finish_reason=finish_reason, stats=stats or {})))
        self.endInsertRows()
        return n

    def append_text(self, row: int, text: str) -> None:
        """Streaming: add ``text`` to ``row``'s content (one ``dataChanged`` for that row)."""
        self._rows[row]["content"] += text
        idx = self.index(row)
        self.dataChanged.emit(idx, idx, [Qt.ItemDataRole.DisplayRole, self.ContentRole])

    def set_progress(self, row: int, done: int, total: int, left: float | None = None) -> None:
        """The reply at ``row`` has read ``done`` of its ``total`` prompt tokens; ``left``: the
        seconds it still takes (None: not known yet)."""
        if 0 <= row < len(self._rows) and self._rows[row]["streaming"]:
            self._rows[row]["progress"] = (done, total, left)
            idx = self.index(row)
            self.dataChanged.emit(idx, idx, [self.ProgressRole])

    def finish(self, row: int, *, id: int | None = None, finish_reason: str | None = None,
               stats: dict | None = None, content: str | None = None, version: int = 0, versions: int = 0) -> None:
        """The reply at ``row`` is done (or, with the fields of another branch, shows that branch)."""
        r = self._rows[row]
        r.update(streaming=False, finish_reason=finish_reason, stats=dict(stats or {}), progress=None,
                 version=int(version), versions=int(versions))
        if id is not None:
            r["id"] = id
        if content is not None:
            r["content"] = content
        idx = self.index(row)
        self.dataChanged.emit(idx, idx)

    def remove_from(self, row: int) -> None:
        """Remove ``row`` and every row after it."""
        n = len(self._rows)
        if 0 <= row < n:
            self.beginRemoveRows(QModelIndex(), row, n - 1)
            del self._rows[row:]
            self.endRemoveRows()

    def last_row(self, role: str) -> int:
        """The last row with ``role``, or -1."""
        for i in range(len(self._rows) - 1, -1, -1):
            if self._rows[i]["role"] == role:
                return i
        return -1

    def message(self, row: int) -> dict[str, Any]:
        return dict(self._rows[row])

    @staticmethod
    def _row(m: dict[str, Any]) -> dict[str, Any]:
        return {"id": m.get("id"), "role": m["role"], "content": m.get("content", ""),
                "streaming": bool(m.get("streaming", False)), "finish_reason": m.get("finish_reason"),
                "stats": dict(m.get("stats") or {}), "progress": None,
                "version": int(m.get("version") or 0), "versions": int(m.get("versions") or 0)}
