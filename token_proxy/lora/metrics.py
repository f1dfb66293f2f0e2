"""The loaded LoRA adapters in /metrics, read from the registry at scrape time (no bookkeeping).

token_proxy_lora_adapter_loaded_timestamp_seconds{adapter, version, internal, path}: when each served
adapter's current version was loaded (SGLang has no per-adapter weight version; the proxy's load count
is it). token_proxy_lora_adapter_requests_in_flight{adapter, version}: leases, incl. replaced versions.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from token_proxy.lora.registry import AdapterRegistry

PREFIX = "token_proxy_lora_adapter_"


class AdapterCollector:
    def __init__(self, registry: AdapterRegistry):
        self.registry = registry

    def collect(self):
        loaded = GaugeMetricFamily(PREFIX + "loaded_timestamp_seconds",
                                   "When the served version of each LoRA adapter was loaded",
                                   labels=["adapter", "version", "internal", "path"])
        for adapter in self.registry.adapters():
            loaded.add_metric([adapter.name, str(adapter.version), adapter.internal, adapter.path], adapter.loaded_at)
        in_flight = GaugeMetricFamily(PREFIX + "requests_in_flight", "Requests holding each LoRA adapter version",
                                      labels=["adapter", "version"])
        for adapter in self.registry.held():
            in_flight.add_metric([adapter.name, str(adapter.version)], self.registry.in_use(adapter))
        yield loaded
        yield in_flight
