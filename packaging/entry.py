"""The frozen app's entry point: what PyInstaller's bootloader runs as ``__main__``.

The installed app (``.venv/bin/attnchat``) starts at ``attnchat.cli:main``; the frozen
one starts here, which first does what only a frozen app needs:

- forces the model hubs offline (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``) before
  transformers is imported: the libraries never download from a hub while loading a
  model, and an attempt would hang on a machine without network; only attnchat's own
  Hub commands (models.hub) still reach the Hugging Face Hub, unless the user had set
  ``HF_HUB_OFFLINE`` themselves;
- gives ``multiprocessing`` its freeze support (a child process of a frozen app is
  the app itself, started with multiprocessing's arguments);
- runs ``attnchat --attnchat-run-module attnchat.bench.worker ...``, how ``attnchat bench``
  starts its workers, and the same for ``models.safety.template_worker``, the chat-template
  sandbox's child (``models.child.python_command`` writes both), since a frozen app has no
  interpreter to take ``-m``.
"""
from __future__ import annotations

import multiprocessing
import os
import sys

#: Modules a frozen app runs for ``<app> --attnchat-run-module MODULE`` (only these: it is no interpreter).
RUNNABLE_MODULES = ("attnchat.bench.worker", "models.safety.template_worker")


def main() -> int:
    multiprocessing.freeze_support()
    truthy = {"1", "ON", "YES", "TRUE"}
    user_offline = any(os.environ.get(k, "").strip().upper() in truthy for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    if not user_offline:
        # attnchat's own switch (models.hub.api.APP_OFFLINE_ENV): the libraries stay offline, but
        # File > Models… and `attnchat models fetch` may still reach the Hugging Face Hub.
        os.environ["ATTNCHAT_HUB_OFFLINE_BY_APP"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from models.child import FROZEN_MODULE_FLAG

    if len(sys.argv) > 2 and sys.argv[1] == FROZEN_MODULE_FLAG and sys.argv[2] in RUNNABLE_MODULES:
        import runpy

        module = sys.argv[2]
        sys.argv = [sys.argv[0]] + sys.argv[3:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    from attnchat.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
