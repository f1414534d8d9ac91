"""attnchat's desktop app (PySide6). Imports runtime's public API and models only."""
