"""Published measurements behind the GPU presets' time model: GEMM efficiency per shape, collective bandwidth and
latency per operation and link.

The figures live in ``lightning_par/planner/data/calibration.json`` (package data), each number with its source
(title, URL, table or figure) or marked ``"assumption"`` with the reasoning; none is fitted to Megatron-LM's PTD-P
Table 1 (Narayanan et al. 2021), which validates the planner (``tests/planner/test_planner_megatron.py``).

* **GEMM efficiency** of an ``(m x k) @ (k x n)`` product (:meth:`DeviceCalibration.gemm_efficiency`): the best
  bf16 matmul rate measured over a shape sweep (the "maximum achievable matmul FLOPS", a fraction ``plateau`` of the
  datasheet peak), scaled by wave quantization (NVIDIA's Matrix Multiplication Background User's Guide, §3.2: the
  output's ``ceil(m/tm) ceil(n/tn)`` tiles run in waves of one tile per SM, and a partial last wave idles SMs; the
  best-quantizing of the guide's most efficient tiles is taken), and bounded by memory (the guide's ch. 2: an
  operation reading ``m k + k n`` and writing ``m n`` elements cannot finish before they move at the memory
  bandwidth). Small GEMMs, and the attention core's ``head_dim``-deep products, therefore run below the plateau.
* **Collective links** (:meth:`DeviceCalibration.link`): nccl-tests bus bandwidth (the rate at which the planner's
  ring volumes, :mod:`lightning_par.comm_cost`, move) and per-step latency for ``all_reduce``, ``all_gather``,
  ``reduce_scatter``, ``all_to_all`` and ``p2p``, inside a node (NVLink) and across nodes (per network adapter).
  Inside a node the all-reduce's bus bandwidth was published per payload (32 KiB to 16 GiB): a collective of a known
  payload takes the rate measured there (interpolated in ``log(payload)``), which includes its latency; the other
  ring collectives follow the same curve's shape from their own large-payload figure.

:func:`layer_matmul_rates` turns a model and layout into the FLOP/s of one transformer layer's matmuls and of the LM
head on one rank; :mod:`lightning_par.planner.step_time` divides FLOPs by them. Pure Python: no torch import.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from lightning_par.planner.layouts import sequence_split

__all__ = [
    "COLLECTIVE_OPS",
    "DeviceCalibration",
    "LinkFigures",
    "calibration_for",
    "layer_gemm_shapes",
    "layer_matmul_rates",
    "load_calibration",
]

#: Operations whose bandwidth and latency the data file gives, per link (``"intra"`` node, ``"inter"`` node).
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
_LINKS = ("intra", "inter")


@dataclass(frozen=True)
class LinkFigures:
    """Measured rates of one operation on one link.

    Attributes:
        bandwidth: bus bandwidth at large payloads, bytes/s (nccl-tests' busBw: what the ring volumes of
            :mod:`lightning_par.comm_cost` move at).
        latency_s: seconds per ring step (alpha-beta model), used where no payload curve applies.
        curve: ``((payload bytes, busbw bytes/s), ...)`` measured per payload, ascending; empty if none.
        curve_of: another op whose curve's shape (busbw over its largest-payload busbw) this op follows, or None.
    """

    bandwidth: float
    latency_s: float
    curve: tuple[tuple[float, float], ...] = ()
    curve_of: str | None = None


def _interpolate(curve: tuple[tuple[float, float], ...], payload: float) -> float:
    """busbw at ``payload`` bytes: linear in ``log(payload)`` between measured points, the end values beyond."""
    if payload <= curve[0][0]:
        return curve[0][1] * payload / curve[0][0]  # below the smallest payload: its time (the latency floor)
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if payload <= x1:
            w = math.log(payload / x0) / math.log(x1 / x0)
            return y0 + w * (y1 - y0)
    return curve[-1][1]


@dataclass(frozen=True)
class DeviceCalibration:
    """Measured figures of one device family (see the module docstring).

    Attributes:
        name: the family's key in the data file (``"a100"``, ``"h100"``).
        presets: the :data:`~lightning_par.planner.devices.DEVICE_PRESETS` keys it applies to.
        plateau: best measured matmul FLOP/s over the datasheet peak, in (0, 1].
        sm_count: streaming multiprocessors (tiles run in waves of ``sm_count``).
        tiles: candidate output tiles ``(rows, cols)``.
        links: ``((link, op), LinkFigures)`` for every link (``"intra"``, ``"inter"``) and op.
    """

    name: str
    presets: tuple[str, ...]
    plateau: float
    sm_count: int
    tiles: tuple[tuple[int, int], ...]
    links: tuple[tuple[tuple[str, str], LinkFigures], ...]

    def figures(self, op: str, inside_node: bool) -> LinkFigures:
        """The :class:`LinkFigures` of ``op`` inside a node (NVLink) or across nodes (one network adapter).

        Raises:
            ValueError: an unknown ``op`` (the message lists the valid ones).
        """
        if op not in COLLECTIVE_OPS:
            raise ValueError(f"op={op!r} is not valid: expected one of {list(COLLECTIVE_OPS)}.")
        return dict(self.links)[("intra" if inside_node else "inter", op)]

    def link(self, op: str, inside_node: bool, payload_bytes: float | None = None) -> tuple[float, float]:
        """``(bus bandwidth in bytes/s, latency in seconds per ring step)`` of ``op`` inside a node or across nodes
        (one network adapter; the planner multiplies by a group's members per node).

        With ``payload_bytes`` (the collective's buffer, as nccl-tests' "size") and a measured payload curve (its
        own, or the shape of another op's), the bandwidth is the one measured at that payload and the latency 0:
        the measured time includes it. Otherwise the large-payload bandwidth and the per-step latency.

        Raises:
            ValueError: an unknown ``op``, or a payload that is not positive.
        """
        fig = self.figures(op, inside_node)
        if payload_bytes is None:
            return fig.bandwidth, fig.latency_s
        if not payload_bytes > 0:
            raise ValueError(f"payload_bytes={payload_bytes!r} is not valid: expected a number > 0.")
        if fig.curve:
            return _interpolate(fig.curve, payload_bytes), 0.0
        if fig.curve_of is not None:
            curve = self.figures(fig.curve_of, inside_node).curve
            return fig.bandwidth * _interpolate(curve, payload_bytes) / curve[-1][1], 0.0
        return fig.bandwidth, fig.latency_s

    def wave_efficiency(self, m: int, n: int) -> float:
        """Busy share of the SMs over the waves an ``m x n`` output needs, for the best-quantizing tile (NVIDIA's
        Matrix Multiplication Background User's Guide, §3.2). 1.0 when the tiles fill their waves."""
        return _wave_efficiency(self.tiles, self.sm_count, m, n)

    def gemm_efficiency(self, m: int, n: int, k: int, peak_flops: float, memory_bandwidth: float,
                        element_bytes: int = 2) -> float:
        """Fraction of ``peak_flops`` an ``(m x k) @ (k x n)`` matmul reaches.

        ``plateau * wave_efficiency(m, n)`` while compute-bound; below it when moving its operands and result
        (``(m k + k n + m n) * element_bytes`` bytes) at ``memory_bandwidth`` takes longer than its ``2 m n k``
        FLOPs.

        Args:
            m, n, k: the product's sizes (positive).
            peak_flops: datasheet peak, FLOP/s.
            memory_bandwidth: bytes/s.
            element_bytes: bytes per operand element (2 for bf16).

        Returns:
            A fraction in (0, plateau].

        Raises:
            ValueError: a size that is not a positive integer.
        """
        for label, v in (("m", m), ("n", n), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{label}={v!r} is not valid: expected a positive integer.")
        flops = 2.0 * m * n * k
        math_s = flops / (peak_flops * self.plateau * self.wave_efficiency(m, n))
        memory_s = (m * k + k * n + m * n) * element_bytes / memory_bandwidth
        return flops / (peak_flops * max(math_s, memory_s))


def _number(entry: Any, where: str, sources: dict) -> Any:
    if not isinstance(entry, dict) or "value" not in entry:
        raise ValueError(f"calibration {where}={entry!r} is not valid: expected {{'value', 'source', 'note'}}.")
    source = entry.get("source")
    if source != "assumption" and source not in sources:
        raise ValueError(
            f"calibration {where}.source={source!r} is not valid: expected 'assumption' or one of {sorted(sources)}."
        )
    if not entry.get("note"):
        raise ValueError(f"calibration {where}.note is missing: say what the figure is (or why it is assumed).")
    return entry["value"]


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"calibration {where}={value!r} is not valid: expected a number > 0.")
    return float(value)


def _parse(data: dict) -> dict[str, DeviceCalibration]:
    sources = data.get("sources")
    if not isinstance(sources, dict) or not sources:
        raise ValueError("calibration 'sources' is missing: expected a mapping of source keys to title/url/where.")
    for key, src in sources.items():
        missing = [f for f in ("title", "url", "where") if not (isinstance(src, dict) and src.get(f))]
        if missing:
            raise ValueError(f"calibration sources.{key} is not valid: missing {missing}.")
    out: dict[str, DeviceCalibration] = {}
    for name, dev in (data.get("devices") or {}).items():
        at = f"devices.{name}"
        gemm = dev["gemm"]
        plateau = _positive(_number(gemm["plateau"], f"{at}.gemm.plateau", sources), f"{at}.gemm.plateau")
        if plateau > 1:
            raise ValueError(f"calibration {at}.gemm.plateau={plateau!r} is not valid: expected a fraction in (0, 1].")
        sm_count = _number(gemm["sm_count"], f"{at}.gemm.sm_count", sources)
        if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1:
            raise ValueError(f"calibration {at}.gemm.sm_count={sm_count!r} is not valid: expected a positive integer.")
        tiles = tuple(tuple(int(x) for x in t) for t in _number(gemm["tiles"], f"{at}.gemm.tiles", sources))
        if not tiles or any(len(t) != 2 or min(t) < 1 for t in tiles):
            raise ValueError(f"calibration {at}.gemm.tiles={tiles!r} is not valid: expected [[rows, cols], ...].")
        links = []
        for link in _LINKS:
            for op in COLLECTIVE_OPS:
                entry = dev["links"].get(link, {}).get(op)
                if entry is None:
                    raise ValueError(
                        f"calibration {at}.links.{link}.{op} is missing: expected bandwidth and latency_s.")
                where = f"{at}.links.{link}.{op}"
                bw = _positive(_number(entry["bandwidth"], f"{where}.bandwidth", sources), f"{where}.bandwidth")
                lat = _number(entry["latency_s"], f"{where}.latency_s", sources)
                if isinstance(lat, bool) or not isinstance(lat, (int, float)) or lat < 0:
                    raise ValueError(f"calibration {where}.latency_s={lat!r} is not valid: expected a number >= 0.")
                curve: tuple = ()
                if "busbw_curve" in entry:
                    raw = _number(entry["busbw_curve"], f"{where}.busbw_curve", sources)
                    curve = tuple((_positive(x, f"{where}.busbw_curve"), _positive(y, f"{where}.busbw_curve"))
                                  for x, y in raw)
                    if len(curve) < 2 or any(b[0] <= a[0] for a, b in zip(curve, curve[1:])):
                        raise ValueError(f"calibration {where}.busbw_curve is not valid: expected at least two "
                                         f"[payload, busbw] points with payloads ascending.")
                curve_of = None
                if "curve_shape" in entry:
                    curve_of = _number(entry["curve_shape"], f"{where}.curve_shape", sources)
                    if curve_of not in COLLECTIVE_OPS or "busbw_curve" not in dev["links"][link].get(curve_of, {}):
                        raise ValueError(f"calibration {where}.curve_shape={curve_of!r} is not valid: expected an op "
                                         f"of the same link with a busbw_curve.")
                links.append(((link, op), LinkFigures(bw, float(lat), curve, curve_of)))
        out[name] = DeviceCalibration(name=name, presets=tuple(dev.get("presets", ())), plateau=plateau,
                                      sm_count=sm_count, tiles=tiles, links=tuple(links))
    return out


@lru_cache(maxsize=None)
def _load_default() -> dict[str, DeviceCalibration]:
    text = resources.files("lightning_par.planner").joinpath("data", "calibration.json").read_text()
    return _parse(json.loads(text))


def load_calibration(path: str | Path | None = None) -> dict[str, DeviceCalibration]:
    """Read and check a calibration file (None: the packaged ``data/calibration.json``).

    Returns:
        Family name -> :class:`DeviceCalibration`.

    Raises:
        ValueError: a number without ``value``, ``note`` or a known ``source``; a missing op or link; a figure out of
            range (the message names the field and the value).
    """
    if path is None:
        return _load_default()
    return _parse(json.loads(Path(path).read_text()))


def calibration_for(key: str | None) -> DeviceCalibration | None:
    """The packaged calibration of family ``key`` (None: none).

    Raises:
        ValueError: an unknown family (the message lists the known ones).
    """
    if key is None:
        return None
    known = load_calibration()
    if key not in known:
        raise ValueError(f"calibration={key!r} is not valid: expected None or one of {sorted(known)}.")
    return known[key]


def layer_gemm_shapes(model: Any, layout: Any) -> list[tuple[int, int, int, int]]:
    """The matmuls of one transformer layer's forward for one micro-batch on one rank, as ``(m, n, k, count)``.

    Tokens ``T = b s / cp``; Megatron's splits over ``t`` (Shoeybi et al. 2019, §3): q/k/v ``(T, h) @ (h, 3h/t)``,
    the attention output ``(T, h/t) @ (h/t, h)``, the MLP's ``(T, h) @ (h, f/t)`` and ``(T, f/t) @ (f/t, h)``; per
    head (``b a / t`` of them) the scores ``(s/cp, d) @ (d, s)`` and the weighted sum ``(s/cp, s) @ (s, d)``, ``d``
    the head size.
    """
    t, split, b = layout.tp_size, sequence_split(layout), layout.micro_batch_size
    s, h, a, f = model.seq_len, model.hidden_size, model.num_heads, model.ffn
    T, sq, d, heads = b * s // split, s // split, h // a, b * a // t
    return [
        (T, 3 * h // t, h, 1), (T, h, h // t, 1), (T, f // t, h, 1), (T, h, f // t, 1),
        (sq, s, d, heads), (sq, d, s, heads),
    ]


def _training_seconds(cal: DeviceCalibration, device: Any, shapes, element_bytes: int) -> tuple[float, float]:
    """FLOPs and seconds of forward (``m n k``), input-gradient (``m k n``) and weight-gradient (``k n m``)
    products of ``shapes``."""
    flops = seconds = 0.0
    for m, n, k, count in shapes:
        f = 2.0 * m * n * k * count
        for mm, nn, kk in ((m, n, k), (m, k, n), (k, n, m)):
            eff = cal.gemm_efficiency(mm, nn, kk, device.peak_flops, device.memory_bandwidth, element_bytes)
            flops += f
            seconds += f / (device.peak_flops * eff)
    return flops, seconds


def layer_matmul_rates(model: Any, layout: Any, device: Any, element_bytes: int = 2) -> tuple[float, float]:
    """FLOP/s of one layer's matmuls and of the LM head's on one rank, training (forward, input and weight
    gradients: the FLOP-weighted harmonic mean of :meth:`DeviceCalibration.gemm_efficiency` over
    :func:`layer_gemm_shapes`, times ``peak_flops``).

    A device without a calibration (``device.calibration is None``: the CPU, a custom spec) runs every matmul at
    ``device.achieved_flops``.

    Args:
        model: a :class:`~lightning_par.planner.model.ModelSpec`.
        layout: a :class:`~lightning_par.planner.layouts.Layout`.
        device: a :class:`~lightning_par.planner.devices.DeviceSpec`.
        element_bytes: bytes per operand element.

    Returns:
        ``(layer FLOP/s, head FLOP/s)``.

    Raises:
        ValueError: the device names an unknown calibration.
    """
    cal = calibration_for(getattr(device, "calibration", None))
    if cal is None:
        return device.achieved_flops, device.achieved_flops
    flops, seconds = _training_seconds(cal, device, layer_gemm_shapes(model, layout), element_bytes)
    tokens = layout.micro_batch_size * model.seq_len // sequence_split(layout)
    head = [(tokens, max(1, math.ceil(model.vocab_size / layout.tp_size)), model.hidden_size, 1)]
    head_flops, head_seconds = _training_seconds(cal, device, head, element_bytes)
    return flops / seconds, head_flops / head_seconds


@lru_cache(maxsize=65536)
def _wave_efficiency(tiles: tuple[tuple[int, int], ...], sm_count: int, m: int, n: int) -> float:
    """:meth:`DeviceCalibration.wave_efficiency`, memoized: a plan of 7,212 layouts asks for the same few hundred
    shapes about 150,000 times (half the planner's time before)."""
    best = 0.0
    for tm, tn in tiles:
        tiles_ = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles_ / sm_count)
        # the tile's useful share (tile quantization, §3.1) times the SMs' busy share over the waves (§3.2)
        useful = (m * n) / (math.ceil(m / tm) * tm * math.ceil(n / tn) * tn)
        best = max(best, useful * tiles_ / (waves * sm_count))
    return best
