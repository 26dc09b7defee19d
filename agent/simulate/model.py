"""One simulated GPU's behaviour over scenario time, free of NVML's C shapes (fake_nvml.py adds those).

Units here are the scenario's: utilization as 0-1, watts, bytes, °C, MHz; fake_nvml converts.
"""

from __future__ import annotations

import bisect
import math
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from gpuscope.simulate.hardware import HardwareModel
from gpuscope.simulate.patterns import noise_stream
from gpuscope.simulate.scenario import REASON_BITS, FailureSpec, GpuSpec, ProcessSpec
from gpuscope.simulate.timeline import (
    BUFFER_TICKS,
    TICKS_PER_SECOND,
    Integral,
    Phase,
    first_tick_after,
    last_complete_tick,
    resolve_phases,
    tick_middle,
    tick_timestamp_us,
)

_RATE_WINDOW_TICKS = TICKS_PER_SECOND  # GetUtilizationRates, power and clocks: the last second
_THERMAL_WINDOW_TICKS = 5 * TICKS_PER_SECOND  # temperature follows a 5 s average, not each sample
_MAX_AVERAGE_TICKS = 600  # a long GPM interval is averaged over at most this many ticks
_MEMO_SIZE = 512  # utilization values remembered per GPU: reuse within a few ticks, bounded memory
# Tick records and window results remembered per GPU: a sampler looks back at most a buffer's worth
# (BUFFER_TICKS) or a thermal window. Adding tick k forgets tick k - _TICK_MEMO_SIZE, so a clock that
# moves forward keeps this many; past twice as many (a clock moving about) the memo restarts.
_TICK_MEMO_SIZE = 256  # > BUFFER_TICKS + the thermal window
_MAX_OCCURRENCES = 100  # Xid occurrences per event per scan, should a clock jump far ahead
_PCI_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)  # a typical 8-GPU server's layout
_POWER_CAP = REASON_BITS["sw_power_cap"]
_GPU_IDLE = REASON_BITS["gpu_idle"]


def _remember(memo: dict[Any, Any], key: Any, stale: Any) -> None:
    """Make room in a tick-keyed memo for ``key``: forget ``stale`` (the key as old as the memo is
    long), and everything should the memo have grown past twice its size anyway."""
    memo.pop(stale, None)
    if len(memo) > 2 * _TICK_MEMO_SIZE:
        memo.clear()


class _Tick(NamedTuple):
    """What the simulated driver records for one tick."""

    utilization: float  # 0-1, at the tick's middle
    sample: tuple[int, int] | None  # (timestamp µs, utilization %); None: no sample (lost or idle)
    processes: tuple[tuple[int, int, int, int], ...]  # (pid, timestamp µs, sm %, memory %) per process
    gpm_levels: tuple[float, float, float, float]  # sm_active, sm_occupancy, tensor_active, dram_active
    # ... each times the utilization


@dataclass(frozen=True)
class SimProcess:
    spec: ProcessSpec
    pid: int
    share: float  # of the GPU's utilization, when the process has no pattern of its own
    stream: int  # noise stream of its own pattern


class GpuModel:
    """What one GPU does at any scenario time. Not thread-safe: the fake library holds a lock."""

    def __init__(self, index: int, spec: GpuSpec, *, scenario_name: str, seed: int,
                 period: float | None, pids: list[int]) -> None:
        self.index = index
        self.spec = spec
        self.period = period
        derived = uuid.uuid5(uuid.NAMESPACE_URL, f"gpuscope-sim/{scenario_name}/{index}")
        self.uuid = spec.uuid or f"GPU-{derived}"
        bus = _PCI_BUSES[index] if index < len(_PCI_BUSES) else 0x10 + index
        self.pci_bus_id = spec.pci_bus_id or f"00000000:{bus:02X}:00.0"
        self.phases = resolve_phases(spec)
        self._starts = [p.start for p in self.phases]
        self._stream = noise_stream(seed, index)
        self._memo: dict[float, float] = {}
        default_share = 1.0 / max(1, len(spec.processes))
        self.processes = [
            SimProcess(p, pid, default_share if p.sm_share is None else p.sm_share,
                       noise_stream(seed, index, i + 1))
            for i, (p, pid) in enumerate(zip(spec.processes, pids, strict=True))
        ]
        self._energy_j = Integral(self._power_at_tick, period)
        self._tx = Integral(lambda tau: float(self.phase(tau).pcie.tx_bytes_per_s), period)
        self._rx = Integral(lambda tau: float(self.phase(tau).pcie.rx_bytes_per_s), period)
        # What the scenario fixes for good, looked up once instead of on every C call.
        self._single_phase = len(self.phases) == 1
        self._lost_windows = list(spec.lost)
        self._failures: dict[str, list[FailureSpec]] = {}
        for f in spec.failures:
            self._failures.setdefault(f.function, []).append(f)
        self.may_fail = bool(self._lost_windows or self._failures)  # any lost window or injected error
        self._all_memory = spec.memory.base_used + sum(p.spec.memory for p in self.processes)
        self._all_of_kind: dict[str, tuple[SimProcess, ...]] = {}
        for proc in self.processes:
            self._all_of_kind[proc.spec.kind] = (*self._all_of_kind.get(proc.spec.kind, ()), proc)
        # With no process ever stopping, every process is active from the latest start on.
        self._all_active_from: float | None = (
            max((p.spec.start for p in self.processes), default=0.0)
            if all(p.spec.stop is None for p in self.processes) else None)
        # Per-tick results, pure functions of a tick number (or a window's last tick): a sampler asks
        # about the same recent ticks from several C functions and again on its next tick.
        self._ticks: dict[int, _Tick] = {}  # k -> what tick k records
        self._mean_memo: dict[tuple[int, int], float] = {}  # (last tick, window) -> mean utilization
        self._rates_memo: dict[int, tuple[int, int]] = {}  # last tick -> GetUtilizationRates' answer
        # The last buffer read, by (cursor, last tick): a sampler reads each buffer twice (size, then fill).
        self._samples_last: tuple[tuple[int, int], list[tuple[int, int]]] | None = None
        self._process_last: tuple[tuple[int, int], list[tuple[int, int, int, int]]] | None = None
        self.hardware = HardwareModel(self, seed)

    # ---------------------------------------------------------------- instantaneous behaviour

    def loop_time(self, t: float) -> float:
        return t % self.period if self.period is not None else t

    def phase(self, tau: float) -> Phase:
        if self._single_phase:
            return self.phases[0]
        return self.phases[max(0, bisect.bisect_right(self._starts, tau) - 1)]

    def utilization(self, tau: float) -> float:
        # Memoised: one NVML call looks at the same recent ticks several times (power, clocks, reasons).
        value = self._memo.get(tau)
        if value is None:
            if len(self._memo) > _MEMO_SIZE:
                self._memo.clear()
            phase = self.phase(tau)
            value = phase.utilization.value(tau - phase.start, self._stream, math.floor(tau * 1000))
            self._memo[tau] = value
        return value

    def _tick(self, k: int) -> _Tick:
        """What tick ``k`` records, computed once (memoised by tick number): every C function that
        looks at recent ticks reads these, and a sampler asks about each tick from several of them."""
        record = self._ticks.get(k)
        if record is not None:
            return record
        middle = tick_middle(k)
        tau = self.loop_time(middle)
        util = self.utilization(tau)
        gpm = self.phase(tau).gpm
        lost = self.lost(middle)
        if self._all_active_from is not None and tau >= self._all_active_from:
            active = self.processes  # not copied: only read here
        else:
            active = [p for p in self.processes if p.spec.active(tau)]
        timestamp = tick_timestamp_us(k)
        # A lost or idle GPU (no context, no kernels) records no utilization sample.
        sample = None if lost or (util == 0.0 and not active) else (timestamp, round(util * 100))
        processes: tuple[tuple[int, int, int, int], ...] = ()
        dram = gpm.dram_active
        if not lost:
            rows = []
            for proc in active:
                pattern = proc.spec.utilization
                if pattern is None:  # process_utilization(), inlined: this runs per process and tick
                    sm = proc.share * util
                else:
                    sm = pattern.value(tau - proc.spec.start, proc.stream, math.floor(tau * 1000))
                rows.append((proc.pid, timestamp, round(sm * 100), round(sm * dram * 100)))
            processes = tuple(rows)
        _remember(self._ticks, k, k - _TICK_MEMO_SIZE)
        record = self._ticks[k] = _Tick(util, sample, processes, (
            gpm.sm_active * util, gpm.sm_occupancy * util, gpm.tensor_active * util, dram * util))
        return record

    def active_processes(self, tau: float) -> list[SimProcess]:
        if self._all_active_from is not None and tau >= self._all_active_from:
            return list(self.processes)
        return [p for p in self.processes if p.spec.active(tau)]

    def active_processes_of_kind(self, tau: float, kind: str) -> Sequence[SimProcess]:
        """The active processes of one kind ("compute", "graphics"), in scenario order."""
        if self._all_active_from is not None and tau >= self._all_active_from:
            return self._all_of_kind.get(kind, ())
        return [p for p in self.processes if p.spec.active(tau) and p.spec.kind == kind]

    def _any_active(self, tau: float) -> bool:
        if self._all_active_from is not None and tau >= self._all_active_from:
            return bool(self.processes)
        return any(p.spec.active(tau) for p in self.processes)

    def process_utilization(self, proc: SimProcess, tau: float) -> float:
        if proc.spec.utilization is not None:
            return proc.spec.utilization.value(tau - proc.spec.start, proc.stream, math.floor(tau * 1000))
        return proc.share * self.utilization(tau)

    def lost(self, t: float) -> bool:
        if not self._lost_windows:
            return False
        tau = self.loop_time(t)
        return any(w.contains(tau) for w in self._lost_windows)

    def failure(self, function: str, t: float) -> str | None:
        """The error a scenario injects into ``function`` at ``t``, or None."""
        failures = self._failures.get(function)
        if not failures:
            return None
        tau = self.loop_time(t)
        for f in failures:
            if f.contains(tau):
                return f.error
        return None

    def memory_used(self, t: float) -> int:
        tau = self.loop_time(t)
        if self._all_active_from is not None and tau >= self._all_active_from:
            return self._all_memory
        return self.spec.memory.base_used + sum(p.spec.memory for p in self.active_processes(tau))

    def _power_at_tick(self, tau: float) -> float:
        return self._draw(self.phase(tau), self.utilization(tau))[0]

    @staticmethod
    def _draw(phase: Phase, util: float) -> tuple[float, bool]:
        """Watts drawn at ``util`` and whether the power limit clips it (a power cap)."""
        p = phase.power
        draw = p.idle_w + (p.busy_w - p.idle_w) * util
        return (p.limit_w, True) if draw > p.limit_w else (draw, False)

    # ---------------------------------------------------------------- windows of recent ticks

    def _recent(self, t: float, ticks: int) -> Iterator[float]:
        """Loop times of the middles of the last ``ticks`` complete ticks (or of ``t`` before any)."""
        last = last_complete_tick(t)
        if last < 0:
            yield self.loop_time(t)
            return
        for k in range(max(0, last - ticks + 1), last + 1):
            yield self.loop_time(tick_middle(k))

    def mean_utilization(self, t: float, ticks: int = _RATE_WINDOW_TICKS) -> float:
        last = last_complete_tick(t)
        if last < 0:
            return self.utilization(self.loop_time(t))  # before the first tick: the one value at t
        key = (last, ticks)
        value = self._mean_memo.get(key)
        if value is None:
            _remember(self._mean_memo, key, (last - _TICK_MEMO_SIZE, ticks))
            records, tick = self._ticks, self._tick
            window = range(max(0, last - ticks + 1), last + 1)
            values = [(records.get(k) or tick(k)).utilization for k in window]
            value = self._mean_memo[key] = sum(values) / len(values)
        return value

    def power(self, t: float) -> tuple[float, bool]:
        return self._draw(self.phase(self.loop_time(t)), self.mean_utilization(t))

    def power_limit_w(self, t: float) -> float:
        return self.phase(self.loop_time(t)).power.limit_w

    def temperature_c(self, t: float) -> int:
        temp = self.phase(self.loop_time(t)).temperature
        util = self.mean_utilization(t, _THERMAL_WINDOW_TICKS)
        return round(temp.idle_c + (temp.busy_c - temp.idle_c) * util)

    def _idle(self, t: float) -> bool:
        return not self._any_active(self.loop_time(t)) and self.mean_utilization(t) == 0.0

    def sm_clock_mhz(self, t: float) -> int:
        clocks = self.phase(self.loop_time(t)).clocks
        if self._idle(t):
            return clocks.sm_idle_mhz
        draw_w, capped = self.power(t)
        if not capped:
            return clocks.sm_mhz
        # Under a power cap the SM clock drops roughly in proportion to the excess demand.
        p = self.phase(self.loop_time(t)).power
        demand = p.idle_w + (p.busy_w - p.idle_w) * self.mean_utilization(t)
        return max(clocks.sm_idle_mhz, round(clocks.sm_mhz * draw_w / demand))

    def mem_clock_mhz(self, t: float) -> int:
        return self.phase(self.loop_time(t)).clocks.mem_mhz

    def clock_event_mask(self, t: float) -> int:
        mask = self.phase(self.loop_time(t)).reasons
        if self.power(t)[1]:
            mask |= _POWER_CAP  # clipping at the limit is what a software power cap is
        if self._idle(t):
            mask |= _GPU_IDLE
        return mask

    def utilization_rates(self, t: float) -> tuple[int, int]:
        """(gpu %, memory %) over the last second, as nvmlDeviceGetUtilizationRates reports them."""
        last = last_complete_tick(t)
        gpu = self.mean_utilization(t)
        if last < 0:  # before the first complete tick: the values at t
            tau = self.loop_time(t)
            return round(gpu * 100), round(self.phase(tau).gpm.dram_active * self.utilization(tau) * 100)
        rates = self._rates_memo.get(last)
        if rates is None:  # a function of the last complete tick alone
            # dram_active x utilization of each tick of the window (the tick's last GPM level)
            ticks = range(max(0, last - _RATE_WINDOW_TICKS + 1), last + 1)
            mem = sum(self._tick(k).gpm_levels[3] for k in ticks) / len(ticks)
            _remember(self._rates_memo, last, last - _TICK_MEMO_SIZE)
            rates = self._rates_memo[last] = round(gpu * 100), round(mem * 100)
        return rates

    def pcie_rates(self, t: float) -> tuple[float, float]:
        rates = self.phase(self.loop_time(t)).pcie
        return float(rates.tx_bytes_per_s), float(rates.rx_bytes_per_s)

    # ---------------------------------------------------------------- cumulative counters

    def energy_mj(self, t: float) -> int:
        return round(self._energy_j.at(t) * 1000)

    def pcie_bytes(self, t: float) -> tuple[int, int]:
        return round(self._tx.at(t)), round(self._rx.at(t))

    # ---------------------------------------------------------------- the driver's sample buffers

    def _buffered_ticks(self, cursor_us: int, t: float) -> range:
        last = last_complete_tick(t)
        return range(max(0, last - BUFFER_TICKS + 1, first_tick_after(cursor_us)), last + 1)

    def samples_after(self, cursor_us: int, t: float) -> list[tuple[int, int]]:
        """(timestamp µs, utilization %) of the buffered ticks newer than the cursor."""
        key = (cursor_us, last_complete_tick(t))
        if self._samples_last is not None and self._samples_last[0] == key:
            return list(self._samples_last[1])
        out = []
        for k in self._buffered_ticks(cursor_us, t):
            sample = self._tick(k).sample
            if sample is not None:
                out.append(sample)
        self._samples_last = key, out
        return list(out)

    def process_samples_after(self, cursor_us: int, t: float) -> list[tuple[int, int, int, int]]:
        """(pid, timestamp µs, sm %, memory %) per active process and buffered tick newer than the cursor."""
        key = (cursor_us, last_complete_tick(t))
        if self._process_last is not None and self._process_last[0] == key:
            return list(self._process_last[1])
        out: list[tuple[int, int, int, int]] = []
        for k in self._buffered_ticks(cursor_us, t):
            out.extend(self._tick(k).processes)
        self._process_last = key, out
        return list(out)

    def gpm_average(self, t1: float, t2: float, *, pcie: bool = True) -> dict[str, float]:
        """GPM metrics (percent; PCIe in bytes/s) over the interval between two GPM samples.

        ``pcie=False`` leaves out pcie_tx and pcie_rx (for a request that asks for neither)."""
        first = math.floor(t1 * TICKS_PER_SECOND - 0.5) + 1  # ticks whose middle lies in (t1, t2]
        last = math.floor(t2 * TICKS_PER_SECOND - 0.5)
        if last < first:
            tau = self.loop_time(t2)
            util, gpm = self.utilization(tau), self.phase(tau).gpm
            rows = [(gpm.sm_active * util, gpm.sm_occupancy * util, gpm.tensor_active * util,
                     gpm.dram_active * util)]
        else:
            step = max(1, (last - first + 1) // _MAX_AVERAGE_TICKS)
            rows = [self._tick(k).gpm_levels for k in range(first, last + 1, step)]
        sm = occupancy = tensor = dram = 0.0
        for a, b, c, d in rows:  # summed in tick order, one metric at a time, as ever
            sm += a
            occupancy += b
            tensor += c
            dram += d
        n = len(rows)
        fp = self.spec.gpm
        out = {"sm_active": 100.0 * sm / n, "sm_occupancy": 100.0 * occupancy / n,
               "tensor_active": 100.0 * tensor / n, "dram_active": 100.0 * dram / n,
               "fp16_active": 100.0 * fp.fp16_active * sm / n, "fp32_active": 100.0 * fp.fp32_active * sm / n,
               "fp64_active": 100.0 * fp.fp64_active * sm / n}
        if not pcie:
            return out
        if t2 > t1:
            (tx1, rx1), (tx2, rx2) = self.pcie_bytes(t1), self.pcie_bytes(t2)
            out["pcie_tx"], out["pcie_rx"] = (tx2 - tx1) / (t2 - t1), (rx2 - rx1) / (t2 - t1)
        else:
            out["pcie_tx"], out["pcie_rx"] = self.pcie_rates(t2)
        return out

    def xids_between(self, lo: float, hi: float) -> list[tuple[float, int]]:
        """(scenario time, Xid code) of the scheduled Xid events in (lo, hi], oldest first."""
        out: list[tuple[float, int]] = []
        for x in self.spec.xid:
            if self.period is None:
                if lo < x.at <= hi:
                    out.append((x.at, x.code))
                continue
            n_first = max(0, math.floor((lo - x.at) / self.period) + 1)
            n_last = min(math.floor((hi - x.at) / self.period), n_first + _MAX_OCCURRENCES - 1)
            out.extend((x.at + n * self.period, x.code) for n in range(n_first, n_last + 1))
        return sorted(out)
