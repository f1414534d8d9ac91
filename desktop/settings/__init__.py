"""Settings: the QSettings wrapper with its defaults, the settings dialog and its memory planner."""
