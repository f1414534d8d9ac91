"""What each cache policy kept of the default model's abilities, as ``attnchat cache-eval``
measured it (docs/cache-policies.md): the figures the settings show beside each choice.

Must not import Qt or torch: plain data. Measured, not guessed; run ``attnchat cache-eval``
again and copy its figures here when a policy or the default model changes.
"""
from __future__ import annotations

#: ``model``, ``machine``, the full cache's ``(needles found, trials)`` and per policy, per
#: budget (share of the tokens read): ``(needles found, trials, mean NLL change in nats)``.
#: ``attnchat cache-eval`` defaults (10 needles in ~1,080-token conversations, 256 scored
#: tokens after 768 read), 2026-12-01, on a shared 2-vCPU Intel Xeon VM (family 6 model 207, AVX-512,
#: AMX), torch 2.13, float32 cache; 29 min at a 1-minute load of 1.6 at the start and 10.5 at the end
#: (docs/cache-policies.md, docs/cache-eval-smollm2.json). An earlier run gave the same figures but
#: key-norm at 25 % (+0.298).
MEASURED: dict = {
    "model": "SmolLM2-135M-Instruct (Q4_1)",
    "machine": "a 2-vCPU Intel Xeon",
    "full": (9, 10),
    "policies": {
        "sinks-window": {0.5: (4, 10, 0.039), 0.25: (2, 10, 0.114)},
        "h2o": {0.5: (2, 10, 0.013), 0.25: (0, 10, 0.047)},
        "snapkv": {0.5: (1, 10, 0.011), 0.25: (0, 10, 0.099)},
        "tova": {0.5: (6, 10, 0.029), 0.25: (3, 10, 0.083)},
        "key-norm": {0.5: (2, 10, 0.174), 0.25: (0, 10, 0.300)},
    },
}
