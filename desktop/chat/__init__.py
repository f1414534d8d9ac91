"""The chat: the message list and input, the conversation list, the status bar, the SQLite store."""
