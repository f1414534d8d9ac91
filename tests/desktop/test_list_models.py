"""The list models (checked by qtmodeltester) and the conversation filter."""
from __future__ import annotations

from PySide6.QtCore import Qt

from desktop.chat.view import MessageListModel
from desktop.chat.conversations import ConversationFilter, ConversationListModel
from desktop.chat.store import Store


def test_conversation_list_model(qtmodeltester, tmp_path):
    store = Store(tmp_path / "c.sqlite3")
    for title in ("Paris trip", "Python tips", "Groceries"):
        store.create_conversation(title)
    model = ConversationListModel(store)
    qtmodeltester.check(model, force_py=True)
    assert model.rowCount() == 3
    # Renaming through the model writes through to the store.
    idx = model.index(model.row_of(store.conversations()[-1].id))
    assert model.setData(idx, "  Paris   in spring ", Qt.ItemDataRole.EditRole)
    assert idx.data() == "Paris in spring"
    assert store.conversation(idx.data(ConversationListModel.IdRole)).title == "Paris in spring"
    assert not model.setData(idx, "   ")
    proxy = ConversationFilter()
    proxy.setSourceModel(model)
    proxy.setFilterFixedString("PARIS")
    assert proxy.rowCount() == 1 and proxy.index(0, 0).data() == "Paris in spring"
    qtmodeltester.check(proxy, force_py=True)
    store.close()


def test_message_list_model_streams_one_row(qtmodeltester, qtbot):
    model = MessageListModel()
    model.set_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "stats": {"a": 1}}])
    row = model.append("assistant", "", streaming=True)
    with qtbot.waitSignal(model.dataChanged) as blocker:
        model.append_text(row, "**bold**")
    assert blocker.args[0].row() == blocker.args[1].row() == row
    assert model.index(row).data(MessageListModel.ContentRole) == "**bold**"
    qtmodeltester.check(model, force_py=True)
    model.finish(row, id=7, finish_reason="cancelled", stats={"completion_tokens": 1})
    assert model.message(row)["streaming"] is False and model.message(row)["id"] == 7
    assert model.last_row("user") == 0
    model.remove_from(1)
    assert model.rowCount() == 1
