"""Lazy package attributes: a package's public names imported from their
modules on first use, so that importing the package stays cheap."""

from __future__ import annotations

import importlib
from typing import Any


def lazy_attribute(package: str, table: dict[str, str], namespace: dict, name: str) -> Any:
    """Attribute ``name`` of ``package``: imported from the module ``table``
    names for it on first use and kept in ``namespace`` (the package's
    globals); an AttributeError for a name the table lacks."""
    module = table.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value
