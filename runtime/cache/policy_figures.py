"""What each cache policy kept of the default model's abilities, as ``attnchat cache-eval``
measured it (docs/cache-policies.md): the figures the settings show beside each choice.

Must not import Qt or torch: plain data. Measured, not guessed; run ``attnchat cache-eval``
again and copy its figures here when a policy or the default model changes.
"""
from __future__ import annotations

#: ``model``, ``machine``, the full cache's ``(needles found, trials)`` and per policy, per
#: budget (share of the tokens read): ``(needles found, trials, mean NLL change in nats)``.
MEASURED: dict = {}
