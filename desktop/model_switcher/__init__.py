"""File > Models…: switch between the catalog's models (:mod:`.dialog`)."""
from desktop.model_switcher.dialog import ModelsDialog, ModelSwitcher, install

__all__ = ["ModelsDialog", "ModelSwitcher", "install"]
