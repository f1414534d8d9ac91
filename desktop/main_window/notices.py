"""How the window words a notice it shows (the runtime's messages are worded for the command line)."""
from __future__ import annotations

__all__ = ["sentence"]


def sentence(message: str) -> str:
    """``message`` with a capital first letter when its first word is a plain lower-case word: the
    runtime's messages start in lower case for the command line ("the message needs 231 tokens
    …"), a notice in the window reads as a sentence. A first word with a dot, a slash, a digit or
    an underscore (a file name, a path, a model id) is left as it is."""
    first = message.split(" ", 1)[0]
    if first.isalpha() and first.islower():
        return message[:1].upper() + message[1:]
    return message
