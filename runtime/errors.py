"""Typed errors a user can cause. Each message is one line: what was wrong, what to do.

Must not import Qt. The command line prints ``str(error)`` and exits with status 2;
the desktop shows it in one dialog.
"""
from __future__ import annotations


class AttnchatError(Exception):
    """Base class of every error a user can cause (a bad file, a bad setting, ...)."""


class ModelLoadError(AttnchatError):
    """A model file or folder is missing, empty, truncated, pickled or unreadable."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture is readable but not one our decoder runs."""


class ModelFileChanged(AttnchatError):
    """The loaded model's file was removed, replaced, resized or modified since the load
    (:mod:`runtime.weights.file_guard`); ``str()`` starts "the model file changed on disk:
    reload it"."""


class ChatTemplateError(AttnchatError):
    """The model's chat template ran past its time limit or asks for a huge string."""


class ContextOverflowError(AttnchatError):
    """A prompt cannot fit in the context window even after the overflow policy.

    Attributes:
        prompt_tokens: tokens the prompt needs.
        context_limit: tokens the context window holds.
    """

    def __init__(self, message: str, *, prompt_tokens: int = 0, context_limit: int = 0):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context_limit = context_limit


class CacheLimitError(AttnchatError):
    """The KV cache would pass its memory limit (bytes) or its token capacity."""


class DeviceError(AttnchatError):
    """A requested device (e.g. ``cuda``) is not available on this machine."""
