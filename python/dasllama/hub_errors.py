"""The hub's exception, a leaf shared by hub.py and the places it resolves names from (hf.py, stores.py)."""
from __future__ import annotations

from ._core import DasllamaError


class HubError(DasllamaError):
    """A model could not be found, downloaded or verified."""
