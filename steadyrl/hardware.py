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
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Literal, TypeVar

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import REGISTRY, Collector

log = logging.getLogger("steadyrl.local.hardware")

T = TypeVar("T")


class HardwareCollector(Collector):
    """prometheus_client collector of the metrics above. NVML is initialised on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: ModuleType | Literal[False] | None = None  # pynvml once initialised; False: not available
        self._failed: set[str] = set()  # NVML queries that failed (logged once)

    def _init_nvml(self) -> ModuleType | Literal[False]:
        if self._nvml is None:
            try:
                import pynvml  # type: ignore[import-untyped]  # lazy: optional (nvidia-ml-py), first scrape only

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception as e:  # noqa: BLE001  no package, no driver, no device: a CPU host
                log.debug("NVML not available", extra={"error": str(e)})
                self._nvml = False
        return self._nvml

    def _query(self, fn: Callable[..., T], *args: Any) -> T | None:
        """fn(*args), or None when NVML refuses it (a query unsupported on this device, a device
        lost mid-run); each failing query is logged once, the others keep their series."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001  a scrape never fails on one GPU query (module doc)
            if fn.__name__ not in self._failed:
                self._failed.add(fn.__name__)
                log.warning("NVML query failed", extra={"query": fn.__name__, "error": str(e)})
            return None

    def collect(self) -> Iterator[Metric]:
        cores = GaugeMetricFamily("steadyrl_host_cpu_cores", "Cores this process may run on")
        cores.add_metric([], len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
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
                n = self._query(nv.nvmlDeviceGetCount) or 0
                for i in range(n):
                    h, gpu = self._query(nv.nvmlDeviceGetHandleByIndex, i), str(i)
                    if h is None:
                        continue
                    mem = self._query(nv.nvmlDeviceGetMemoryInfo, h)
                    if mem is not None:
                        families["mem"].add_metric([gpu], mem.used)
                        families["total"].add_metric([gpu], mem.total)
                    util = self._query(nv.nvmlDeviceGetUtilizationRates, h)  # unsupported on MIG
                    if util is not None:
                        families["util"].add_metric([gpu], util.gpu / 100.0)
                    temp = self._query(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
                    if temp is not None:
                        families["temp"].add_metric([gpu], temp)
                    for direction, counter in (("tx", nv.NVML_PCIE_UTIL_TX_BYTES), ("rx", nv.NVML_PCIE_UTIL_RX_BYTES)):
                        kb_s = self._query(nv.nvmlDeviceGetPcieThroughput, h, counter)  # KB/s
                        if kb_s is not None:
                            families["pcie"].add_metric([gpu, direction], kb_s * 1024.0)
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


def native_bf16(device: str) -> tuple[bool, str]:
    """Whether `device` ("cpu", or "cuda" / "cuda:N") computes bfloat16 natively, and why (for
    the start-up log). A GPU: torch.cuda.is_bf16_supported() (Ampere and later). A CPU: AVX-512
    BF16 or AMX tiles (torch's own probes); without them torch emulates bf16 matmuls, measured
    ~90x slower than fp32 for SmolLM2's update on a Zen 3 EPYC (docs/benchmarks.md), and vLLM's
    CPU backend 6x slower. The learner's `train.autocast: auto` and the vLLM actor's
    `dtype: auto` both decide by this."""
    import torch  # lazy: heavy; the metrics collector above runs in processes without torch work

    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return True, "this GPU computes bf16 natively"
        return False, "this GPU has no native bf16 (before Ampere)"
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return True, "this CPU computes bf16 natively (AVX-512 BF16 or AMX)"
    return False, "this CPU has no native bf16 (no AVX-512 BF16, no AMX): emulated bf16 is ~90x slower"
