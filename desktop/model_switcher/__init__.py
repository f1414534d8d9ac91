"""File > Models…: the models on this computer and the catalog's (:mod:`.dialog`), the Hugging
Face Hub (:mod:`.hub_browser`, its jobs off the GUI thread in :mod:`.hub_jobs`)."""
from desktop.model_switcher.dialog import ModelsDialog, ModelSwitcher, install
from desktop.model_switcher.hub_browser import HubBrowser
from desktop.model_switcher.hub_jobs import HubService

__all__ = ["HubBrowser", "HubService", "ModelsDialog", "ModelSwitcher", "install"]
