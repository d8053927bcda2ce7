"""The /metrics collector of the server's engine gauges: every numeric field of the last
Engine.stats() snapshot, the step phases' seconds, and the server's own gauges."""

from __future__ import annotations


class EngineCollector:
    """Gauges from the last Engine.stats() snapshot (refreshed by /metrics on the engine thread)."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        s = self.server
        for key, value in sorted(s.engine.last_stats.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                g = GaugeMetricFamily(f"slora_engine_{key}", f"Engine.stats()['{key}']")
                g.add_metric([], float(value))
                yield g
        phases = s.engine.last_stats.get("host_seconds") or {}
        if phases:
            from prometheus_client.core import CounterMetricFamily
            c = CounterMetricFamily("slora_engine_step_phase_seconds",
                                    "Seconds of engine steps by phase (host work vs device wait)", labels=["phase"])
            for phase, seconds in sorted(phases.items()):
                c.add_metric([phase], float(seconds))
            yield c
        g = GaugeMetricFamily("slora_requests_in_flight", "Requests accepted and not yet answered")
        g.add_metric([], float(s.engine.in_flight))
        yield g
        g = GaugeMetricFamily("slora_registered_adapters", "Adapters registered in the host store")
        g.add_metric([], float(len(s.llm.store.entries)))
        yield g
        g = GaugeMetricFamily("slora_engine_alive", "1 while the engine thread runs")
        g.add_metric([], 1.0 if s.engine.alive else 0.0)
        yield g
