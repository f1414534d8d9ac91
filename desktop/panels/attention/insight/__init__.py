"""The attention panel's Insight tab: its views (``views``, ``explain``), their model work on
the engine thread (``probe``), the wiring between them (``controller``) and its screenshots
(``shots``). Must not import torch or runtime, except ``probe`` on the engine thread."""
