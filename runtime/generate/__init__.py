"""Generating replies: chat templates, the chat session (template -> ids -> longest common
prefix -> crop -> prefill in chunks -> decode), context-overflow policies, sampling, logits
processors, constrained decoding, UTF-8-safe streaming and stop strings.

May import :mod:`runtime.loader` and everything below it; never :mod:`runtime.insight` or Qt.
"""
