"""Hardware metrics: NVML through a fake module (no GPU here), and the CPU-only answer."""

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from steadyrl.local.hardware import HardwareCollector


class FakeNVML:
    """Two GPUs; utilisation is unsupported on GPU 0 (as on a MIG-enabled device)."""

    NVML_TEMPERATURE_GPU, NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 0, 1

    def nvmlDeviceGetCount(self): return 2
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetMemoryInfo(self, h): return SimpleNamespace(used=(h + 1) * 2 ** 30, total=80 * 2 ** 30)
    def nvmlDeviceGetTemperature(self, h, kind): return 60 + h
    def nvmlDeviceGetPcieThroughput(self, h, counter): return 1000 * (counter + 1)

    def nvmlDeviceGetUtilizationRates(self, h):
        if h == 0:
            raise RuntimeError("Not Supported")
        return SimpleNamespace(gpu=75)


def scrape(collector) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(collector)
    return reg


def test_a_query_one_gpu_does_not_support_leaves_every_other_series():
    c = HardwareCollector()
    c._nvml = FakeNVML()
    v = scrape(c).get_sample_value
    assert v("steadyrl_gpu_available") == 1.0
    assert v("steadyrl_gpu_memory_used_bytes", {"gpu": "0"}) == 2 ** 30
    assert v("steadyrl_gpu_memory_used_bytes", {"gpu": "1"}) == 2 * 2 ** 30
    assert v("steadyrl_gpu_utilization_ratio", {"gpu": "0"}) is None
    assert v("steadyrl_gpu_utilization_ratio", {"gpu": "1"}) == 0.75
    assert v("steadyrl_gpu_temperature_celsius", {"gpu": "0"}) == 60
    assert v("steadyrl_gpu_pcie_throughput_bytes_per_second", {"gpu": "1", "direction": "rx"}) == 2000 * 1024.0


def test_without_nvml_only_gpu_available_0_and_the_cores():
    c = HardwareCollector()
    c._nvml = False
    v = scrape(c).get_sample_value
    assert v("steadyrl_gpu_available") == 0.0 and v("steadyrl_host_cpu_cores") >= 1
    assert v("steadyrl_gpu_memory_used_bytes", {"gpu": "0"}) is None
