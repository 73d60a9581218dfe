"""GPU telemetry (`--log-gpu-util N`, llm.q's option): every N steps one `gpu` object in the run log with the
device's utilisation, power, clocks, temperature, throttling and memory, read through NVML.

The fields and units are llm.q's (`src/utilities/gpu_info.cpp` via `log_gpu_state`, reference/llmq.md §2.2), so
tools reading either log read both:

    id            device index (as torch numbers it)      clock / max_clock   SM clock, MHz
    gpu_util      % of time a kernel ran (last sample)    mem_util            % of time memory was read/written
    power         mW (current draw)                       power_limit         mW (enforced limit)
    temperature   deg C                                   temp_slowdown       deg C where the GPU slows down
    fan           % (None on passively cooled boards)     throttle            active clock-throttle reasons, e.g. "power"
    dram_free     bytes                                   dram_used / dram_total   bytes
    pcie_rx / pcie_tx   KB/s over the last 20 ms

NVML comes from the `nvidia-ml-py` package (`pip install nvidia-ml-py`, the `gpu` extra); without it, or on a
CPU run, nothing is sampled and the run says so once. A value NVML cannot report on a board is None.
"""
from __future__ import annotations

from typing import Any

__all__ = ["GpuMonitor", "GpuUtilSink", "THROTTLE_REASONS", "throttle_text", "make_gpu_sink"]

# NVML clocks-throttle-reason bits (nvml.h, nvmlClocksThrottleReason*) -> short names; idle is not a throttle
THROTTLE_REASONS = {0x2: "app-clocks", 0x4: "power", 0x8: "hw-slowdown", 0x10: "sync-boost", 0x20: "sw-thermal",
                    0x40: "hw-thermal", 0x80: "power-brake", 0x100: "display-clocks"}


def throttle_text(mask: int) -> str:
    """NVML's throttle-reason bit mask -> comma-separated names ('' when the clocks are not held back)."""
    return ",".join(name for bit, name in THROTTLE_REASONS.items() if mask & bit)


class GpuMonitor:
    """Reads one device's NVML counters. `create` returns None where NVML is missing."""

    def __init__(self, nvml: Any, index: int, uuid: str | None = None):
        self.nvml, self.index = nvml, index
        nvml.nvmlInit()
        # torch numbers devices in CUDA_VISIBLE_DEVICES order, NVML in PCI order: match them by UUID when known
        self.handle = nvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else nvml.nvmlDeviceGetHandleByIndex(index)

    @classmethod
    def create(cls, index: int, uuid: str | None = None) -> "GpuMonitor | None":
        try:
            import pynvml  # the nvidia-ml-py package
        except ImportError:
            return None
        for key in ([uuid] if uuid else []) + [None]:
            try:
                return cls(pynvml, index, key)
            except pynvml.NVMLError:
                continue
        return None

    def _get(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, fn)(self.handle, *args)
        except self.nvml.NVMLError:
            return None

    def sample(self) -> dict[str, Any]:
        n, h = self.nvml, self._get
        util, mem = h("nvmlDeviceGetUtilizationRates"), h("nvmlDeviceGetMemoryInfo")
        throttle = h("nvmlDeviceGetCurrentClocksThrottleReasons")
        return {
            "id": self.index,
            "clock": h("nvmlDeviceGetClockInfo", n.NVML_CLOCK_SM),
            "max_clock": h("nvmlDeviceGetMaxClockInfo", n.NVML_CLOCK_SM),
            "fan": h("nvmlDeviceGetFanSpeed"),
            "power": h("nvmlDeviceGetPowerUsage"),
            "power_limit": h("nvmlDeviceGetEnforcedPowerLimit"),
            "temperature": h("nvmlDeviceGetTemperature", n.NVML_TEMPERATURE_GPU),
            "temp_slowdown": h("nvmlDeviceGetTemperatureThreshold", n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            "gpu_util": None if util is None else util.gpu,
            "mem_util": None if util is None else util.memory,
            "throttle": None if throttle is None else throttle_text(int(throttle)),
            "dram_free": None if mem is None else int(mem.free),
            "dram_used": None if mem is None else int(mem.used),
            "dram_total": None if mem is None else int(mem.total),
            "pcie_rx": h("nvmlDeviceGetPcieThroughput", n.NVML_PCIE_UTIL_RX_BYTES),
            "pcie_tx": h("nvmlDeviceGetPcieThroughput", n.NVML_PCIE_UTIL_TX_BYTES),
        }


class GpuUtilSink:
    """A run-log sink: after every `every`-th step object (steps 0, N, 2N, ...), log one `gpu` sample per
    monitored device (rank 0 watches every GPU of its machine, as llm.q's logger does)."""

    def __init__(self, log: Any, monitors: list[GpuMonitor], every: int):
        self.log, self.monitors, self.every = log, monitors, every

    def on_event(self, obj: dict[str, Any]) -> None:
        if obj.get("log") == "step" and int(obj["step"]) % self.every == 0:
            for m in self.monitors:
                self.log.log_gpu(m.sample(), step=int(obj["step"]))


def make_gpu_sink(log: Any, device: Any, every: int) -> GpuUtilSink | None:
    """The `--log-gpu-util` sink of a run on `device`: all visible GPUs, or None (off, a CPU run, or no NVML:
    said once in the log)."""
    if every <= 0 or getattr(device, "type", "cpu") != "cuda" or getattr(log, "rank", 0) != 0:
        return None
    import torch
    monitors = []
    for index in range(torch.cuda.device_count()):
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        monitor = GpuMonitor.create(index, f"GPU-{uuid}" if uuid is not None else None)
        if monitor is None:
            log.message("--log-gpu-util: NVML is not available (pip install nvidia-ml-py), no GPU telemetry is "
                        "logged", level="warning")
            return None
        monitors.append(monitor)
    return GpuUtilSink(log, monitors, every)
