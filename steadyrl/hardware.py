"""Hardware metrics of every service: GPUs through NVML where there are any, the host's cores.

Collected at scrape time (a prometheus_client collector registered once per process by
`steadyrl.service`), so their interval is Prometheus' scrape interval; the process's own
CPU seconds and resident memory come from prometheus_client's process collector
(`process_cpu_seconds_total`, `process_resident_memory_bytes`).

    steadyrl_host_cpu_cores                     cores this process may run on (sched_getaffinity)
    steadyrl_gpu_available                      1 when NVML found at least one GPU, else 0
    steadyrl_gpu_memory_used_bytes{gpu}         device memory in use (all processes)
    steadyrl_gpu_memory_total_bytes{gpu}
    steadyrl_gpu_utilization_ratio{gpu}         share of the last sample period a kernel ran, 0..1
    steadyrl_gpu_temperature_celsius{gpu}
    steadyrl_gpu_pcie_throughput_bytes_per_second{gpu,direction}   tx | rx, NVML's 20 ms sample

NVML is `nvidia-ml-py` (`pynvml`); without it, or without a driver, only
`steadyrl_gpu_available 0` is exported, never an error.
"""

from __future__ import annotations

import logging
import os
import threading

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

log = logging.getLogger("steadyrl.hardware")


class HardwareCollector(Collector):
    """prometheus_client collector of the metrics above. NVML is initialised on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml = None          # the pynvml module once initialised; False: not available

    def _init_nvml(self):
        if self._nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception as e:  # no package, no driver, no device: a CPU host
                log.debug("NVML not available", extra={"error": str(e)})
                self._nvml = False
        return self._nvml

    def collect(self):
        cores = GaugeMetricFamily("steadyrl_host_cpu_cores", "Cores this process may run on")
        cores.add_metric([], len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
        yield cores
        available = GaugeMetricFamily("steadyrl_gpu_available", "1 when NVML found a GPU, else 0")
        families = {
            "mem": GaugeMetricFamily("steadyrl_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"]),
            "total": GaugeMetricFamily("steadyrl_gpu_memory_total_bytes", "GPU memory", labels=["gpu"]),
            "util": GaugeMetricFamily("steadyrl_gpu_utilization_ratio", "Share of time a kernel ran, 0..1",
                                      labels=["gpu"]),
            "temp": GaugeMetricFamily("steadyrl_gpu_temperature_celsius", "GPU temperature", labels=["gpu"]),
            "pcie": GaugeMetricFamily("steadyrl_gpu_pcie_throughput_bytes_per_second", "PCIe throughput",
                                      labels=["gpu", "direction"]),
        }
        with self._lock:
            nv = self._init_nvml()
            n = 0
            if nv:
                try:
                    n = nv.nvmlDeviceGetCount()
                    for i in range(n):
                        h, gpu = nv.nvmlDeviceGetHandleByIndex(i), str(i)
                        mem = nv.nvmlDeviceGetMemoryInfo(h)
                        families["mem"].add_metric([gpu], mem.used)
                        families["total"].add_metric([gpu], mem.total)
                        families["util"].add_metric([gpu], nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
                        families["temp"].add_metric([gpu], nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
                        for direction, counter in (("tx", nv.NVML_PCIE_UTIL_TX_BYTES),
                                                   ("rx", nv.NVML_PCIE_UTIL_RX_BYTES)):
                            kb_s = nv.nvmlDeviceGetPcieThroughput(h, counter)  # KB/s
                            families["pcie"].add_metric([gpu, direction], kb_s * 1024.0)
                except Exception as e:  # a device lost mid-run: say so in the log, keep serving
                    log.warning("NVML query failed", extra={"error": str(e)})
        available.add_metric([], 1.0 if n > 0 else 0.0)
        yield available
        yield from families.values()


_registered = False


def register() -> None:
    """Register the collector in the default registry (once per process)."""
    global _registered
    if not _registered:
        REGISTRY.register(HardwareCollector())
        _registered = True
