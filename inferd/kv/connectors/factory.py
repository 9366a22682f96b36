"""Connectors by name: `--kv-transfer-config '{"kv_connector": NAME, ...}'` picks one of these."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from inferd.config import KVTransferConfig
from inferd.kv.connectors.base import KVConnectorBase, NullConnector
from inferd.kv.connectors.layout import KVBlockLayout

# name → "module:Class", imported when built (a connector's optional dependencies load only then)
_REGISTRY: dict[str, str | Callable[..., KVConnectorBase]] = {
    "NullConnector": NullConnector,
    "OffloadingConnector": "inferd.kv.connectors.offloading:OffloadingConnector",
    "PDConnector": "inferd.kv.connectors.pd.connector:PDConnector",
}


def register_connector(name: str, target: str | Callable[..., KVConnectorBase]) -> None:
    """Make `name` buildable: `target` is a connector class or "module:Class"."""
    _REGISTRY[name] = target


def connector_names() -> list[str]:
    return sorted(_REGISTRY)


def connector_class(config: KVTransferConfig) -> Callable[..., KVConnectorBase]:
    """What builds the connector `config` names (`NullConnector` where it names none); ValueError
    for an unknown name."""
    name = config.connector_name or "NullConnector"
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"unknown kv_connector {name!r}; known: {', '.join(connector_names())}")
    if isinstance(target, str):
        module, _, cls = target.partition(":")
        target = getattr(importlib.import_module(module), cls)
    return target


def make_connector(config: KVTransferConfig, layout: KVBlockLayout) -> KVConnectorBase:
    """The connector `config` names, built over `layout`."""
    return connector_class(config)(config, layout)
