"""The command line run in the test's own process (no second interpreter's imports)."""
from __future__ import annotations

import subprocess

import pytest

#: What ``attnchat``'s main sets in its own environment (``_quiet_libraries``): set back after each
#: in-process run.
LIBRARY_ENV = ("TQDM_DISABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_VERBOSITY",
               "TOKENIZERS_PARALLELISM")


def cli_in_process(argv: list[str], state_dir) -> subprocess.CompletedProcess:
    """``attnchat ARGV`` run in this process by the command line's own ``main`` (what the entry
    point runs, without a second interpreter importing torch and transformers: seconds a run on
    the 2-vCPU test machine), its output captured. The environment, the log folder (under
    ``state_dir``) and the log handlers it adds are put back; argparse's own errors give their
    exit status. A test of the entry point itself still runs it as a process."""
    import contextlib
    import io
    import logging

    from attnchat import cli

    loggers = [logging.getLogger(), logging.getLogger("py.warnings")]
    handlers = {lg.name: list(lg.handlers) for lg in loggers}
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(state_dir))
        for name in LIBRARY_ENV:
            mp.setenv(name, "1" if name != "TRANSFORMERS_VERBOSITY" else "error")
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    status = cli.main(list(argv))
                except SystemExit as e:
                    status = e.code
        finally:
            logging.captureWarnings(False)  # main routes warnings to the log
            for lg in loggers:
                for h in list(lg.handlers):
                    if h not in handlers[lg.name]:
                        lg.removeHandler(h)
                        h.close()
    return subprocess.CompletedProcess(["attnchat", *argv], status, out.getvalue(), err.getvalue())
