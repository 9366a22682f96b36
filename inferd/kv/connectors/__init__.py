"""KV connectors (docs/kv-connectors.md): the interface (base.py), the registry (factory.py), the
block layout and model fingerprint both ends must agree on (layout.py), and the host/disk KV tier
(offloading.py, store.py)."""
