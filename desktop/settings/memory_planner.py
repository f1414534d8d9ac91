"""The memory planner in the settings dialog: weights, KV cache per token and at a context,
free memory on the chosen device, and the longest context that fits.

The figures come from runtime's planner (:func:`runtime.plan`, the same one behind
``attnchat memory``): KV bytes per token = 2 x layers x KV heads x head dim x bytes per
element. It plans the loaded model, or a model given only as numbers (layers, KV heads,
head dim, parameters), so a user can check a bigger model before fetching it.
Must not import torch.
"""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QDoubleSpinBox, QFormLayout, QGroupBox, QLabel, QSpinBox, QVBoxLayout, QWidget

import runtime
from desktop.settings.variants_table import VariantsTable
from models.kv_bytes import UNBOUNDED

__all__ = ["MemoryPlanner", "fmt_mib", "resolve_device"]

MIB = 2**20
GIB = 2**30
#: The weights' default dtype per device type when none is chosen (runtime.device.default_dtype).
DEFAULT_WEIGHT_DTYPE = {d: str(runtime.default_dtype(d)).removeprefix("torch.") for d in ("cpu", "cuda", "mps")}


def fmt_mib(n: int | float | None) -> str:
    """``n`` bytes as ``"360.0 MiB"``, or ``"12.2 GiB (12,500 MiB)"`` from 1 GiB on; ``"—"`` for None."""
    if n is None:
        return "—"
    if n >= GIB:
        return f"{n / GIB:,.1f} GiB ({n / MIB:,.0f} MiB)"
    return f"{n / MIB:,.1f} MiB"


def resolve_device(device: str, devices: list[str], model: dict | None = None) -> str:
    """``"auto"`` -> what the runtime would pick (the loaded model's device, else CUDA, MPS, CPU)."""
    if device != "auto":
        return device
    if model and model.get("device"):
        return str(model["device"])
    for prefix in ("cuda", "mps"):
        found = [d for d in devices if d.startswith(prefix)]
        if found:
            return found[0]
    return "cpu"


def _layers_text(layers: int, windows) -> str:
    """``"18 layers"``, or ``"18 layers (15 slide over 512 tokens)"``."""
    sliding = [w for w in windows or () if w is not None]
    if not sliding:
        return f"{layers} layers"
    sizes = sorted(set(sliding))
    return f"{layers} layers ({len(sliding)} slide over {', '.join(f'{w:,}' for w in sizes)} tokens)"


class MemoryPlanner(QGroupBox):
    """The planner's inputs (which model) and figures (labels in :attr:`rows`).

    Args:
        model: the loaded model's info dict (``desktop.worker.model_info``), or None.

    Call :meth:`update_plan` whenever the dialog's context, cache dtype, cache limit,
    device or weight dtype change; the model choice here calls it back through
    :attr:`inputs_changed`.
    """

    inputs_changed = Signal()

    LOADED, NUMBERS = 0, 1

    def __init__(self, model: dict | None, parent: QWidget | None = None):
        super().__init__("Memory plan", parent)
        self.setObjectName("memoryPlanner")
        self.model = model
        self._free: dict[str, int | None] = {}
        self.last_plan: runtime.MemoryPlan | None = None
        outer = QVBoxLayout(self)
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.source = QComboBox()
        self.source.setObjectName("plannerSource")
        if model:
            self.source.addItem(f"The loaded model ({model.get('name', 'model')})")
        else:
            self.source.addItem("The loaded model (none is loaded)")
        self.source.addItem("A model given as numbers")
        form.addRow("Plan for", self.source)
        self.numbers = QWidget()
        nf = QFormLayout(self.numbers)
        nf.setContentsMargins(0, 0, 0, 0)
        self.layers = self._spin(1, 1024, 32)
        self.kv_heads = self._spin(1, 1024, 8)
        self.head_dim = self._spin(1, 4096, 128)
        self.context = self._spin(1, 100_000_000, 100_000, step=1024)
        self.params_m = QDoubleSpinBox()
        self.params_m.setRange(0, 10_000_000)
        self.params_m.setDecimals(0)
        self.params_m.setSuffix(" M")
        self.params_m.setSpecialValueText("unknown")
        self.params_m.setValue(8030)
        self.params_m.valueChanged.connect(self.inputs_changed)
        nf.addRow("Layers", self.layers)
        nf.addRow("KV heads per layer", self.kv_heads)
        nf.addRow("Head dim", self.head_dim)
        nf.addRow("Parameters", self.params_m)
        nf.addRow("Context (tokens)", self.context)
        form.addRow(self.numbers)
        outer.addLayout(form)
        self.figures = QFormLayout()
        self.figures.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.rows: dict[str, QLabel] = {}
        for key, title in (("model", "Model"), ("weights", "Weights"), ("per_token", "KV cache per token"),
                           ("at_context", "KV cache at the context"), ("free", "Free memory"),
                           ("total", "Weights + KV cache"), ("in_limit", "Longest context in the cache limit"),
                           ("in_free", "Longest context in free memory")):
            label = QLabel("—")
            label.setObjectName(f"plan_{key}")
            label.setWordWrap(True)
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self.rows[key] = label
            self.figures.addRow(title, label)
        self._titles = {key: self.figures.labelForField(lbl) for key, lbl in self.rows.items()}
        outer.addLayout(self.figures)
        self.variants = VariantsTable()  # multi-head vs grouped-query vs multi-query vs sliding window
        outer.addWidget(self.variants)
        self.source.setCurrentIndex(self.LOADED if model else self.NUMBERS)
        if not model:
            self.source.model().item(self.LOADED).setEnabled(False)
        self.source.currentIndexChanged.connect(self._source_changed)
        self._source_changed()

    def _spin(self, lo: int, hi: int, value: int, step: int = 1) -> QSpinBox:
        s = QSpinBox()
        s.setRange(lo, hi)
        s.setValue(value)
        s.setSingleStep(step)
        s.setGroupSeparatorShown(True)
        s.valueChanged.connect(self.inputs_changed)
        return s

    def _source_changed(self) -> None:
        self.numbers.setVisible(self.source.currentIndex() == self.NUMBERS)
        self.inputs_changed.emit()

    def use_numbers(self, layers: int, kv_heads: int, head_dim: int, context: int, params_m: float = 0) -> None:
        """Plan a model given as numbers (what a user types in)."""
        self.source.setCurrentIndex(self.NUMBERS)
        for w, v in ((self.layers, layers), (self.kv_heads, kv_heads), (self.head_dim, head_dim),
                     (self.context, context), (self.params_m, params_m)):
            w.setValue(v)

    def free_bytes(self, device: str) -> int | None:
        """Free memory on ``device`` (asked once per device while the dialog is open)."""
        if device not in self._free:
            self._free[device] = runtime.free_memory_bytes(device)
        return self._free[device]

    def update_plan(self, *, context: int, cache_dtype: str, budget_bytes: int | None, device: str,
                    weights_dtype: str, policy: str = "none", policy_tokens: int | None = None,
                    policy_bytes: int | None = None) -> runtime.MemoryPlan | None:
        """Recompute the figures. ``context`` 0 = the model's maximum; ``cache_dtype``
        ``"auto"`` = the model's default (:func:`runtime.cache_dtype_for`), ``weights_dtype``
        ``"auto"`` = the loaded model's dtype or the device's default; ``device``
        already resolved (no ``"auto"``). ``policy`` other than ``"none"``: a cache policy keeping
        ``policy_tokens`` per full layer or ``policy_bytes`` of cache: the cache never holds more."""
        m = self.model if self.source.currentIndex() == self.LOADED else None
        wdtype = weights_dtype
        if wdtype == "auto":
            wdtype = m["dtype"] if m and str(m.get("device")) == device else DEFAULT_WEIGHT_DTYPE.get(device.split(":")[0], "float32")
        # a GGUF run from its own blocks names its quantization ("Q4_K_M"): it computes as float16 weights do
        blocks = wdtype not in ("float32", "bfloat16", "float16", "int8")
        windows, n_heads = None, None
        if m:
            layers, kv_heads, head_dim = int(m["n_layers"]), int(m["n_kv_heads"]), int(m["head_dim"])
            context = min(context or int(m["context_limit"]), int(m["context_limit"]))
            weights = m.get("weights_bytes")
            if weights and m.get("dtype") in runtime.CACHE_DTYPES and not blocks:
                weights = weights * runtime.element_bytes(wdtype) // runtime.element_bytes(m["dtype"])
            elif weights and m.get("dtype") != wdtype:  # blocks to another dtype (or back): not known from bytes
                weights = None
            # Sliding layers hold at most their window (Gemma 3: 15 of 18 layers, 512 tokens).
            windows = m.get("layer_windows") if len(m.get("layer_windows") or ()) == layers else None
            n_heads = m.get("n_heads")
            shape = f"{m.get('name', 'model')}: {_layers_text(layers, windows)} × {kv_heads} KV heads × {head_dim} dims"
        else:
            layers, kv_heads, head_dim = self.layers.value(), self.kv_heads.value(), self.head_dim.value()
            context = self.context.value()
            weights = int(self.params_m.value() * 1e6) * runtime.element_bytes(wdtype) or None
            shape = f"{layers} layers × {kv_heads} KV heads × {head_dim} dims"
        if cache_dtype != "auto":
            cdtype = cache_dtype
        elif m and blocks and m.get("cache_dtype"):
            cdtype = m["cache_dtype"]   # the loaded model's own
        else:  # a GGUF's blocks on the CPU: the dtype timed here for the head size, else the compute dtype
            cdtype = str(runtime.cache_dtype_for(device, "float16" if blocks else wdtype, blocks=blocks,
                                                 head_dim=head_dim)).removeprefix("torch.")
        kept = {} if policy == "none" else dict(cache_budget=policy_tokens, cache_budget_bytes=policy_bytes)
        try:
            p = runtime.plan(layers=layers, kv_heads=kv_heads, head_dim=head_dim, cache_dtype=cdtype,
                             context=context, budget_bytes=budget_bytes, device="cpu", windows=windows,
                             n_heads=n_heads, **kept)
        except ValueError as e:
            self.rows["model"].setText(str(e))
            self.variants.clear("Attention variants: no plan (see above).")
            return None
        self.variants.set_variants(p.variants, context=context, cache_dtype=p.cache_dtype, layers=layers)
        self.last_plan = p
        free = self.free_bytes(device)
        r = self.rows
        r["model"].setText(shape)
        r["weights"].setText(f"{fmt_mib(weights)} ({wdtype})" if weights else "unknown: give the parameter count")
        others = [d for d in runtime.CACHE_DTYPES if d != p.cache_dtype]
        per_dtype = ", ".join(f"{d} {runtime.cache_bytes_per_token(layers, kv_heads, head_dim, d):,}" for d in others)
        r["per_token"].setText(f"{p.kv_bytes_per_token:,} bytes ({p.cache_dtype}); {per_dtype}")
        self._titles["at_context"].setText(f"KV cache at {context:,} tokens")
        capped = p.cache_budget is not None and p.cache_budget < context
        r["at_context"].setText(fmt_mib(p.kv_bytes) + (f" (the {policy} cache policy keeps at most {p.cache_budget:,} "
                                                       "tokens per layer)" if capped else ""))
        self._titles["free"].setText(f"Free memory on {device}")
        r["free"].setText(fmt_mib(free) if free is not None else "unknown")
        # The loaded model's weights already sit in that memory: only the cache needs room.
        resident = bool(self.model) and m is self.model and str(self.model.get("device")) == device
        need = p.kv_bytes + (0 if resident or not weights else weights)
        total = (weights or 0) + p.kv_bytes
        if free is None:
            verdict = ""
        elif need <= free:
            verdict = ": fits"
        else:
            verdict = f": does not fit ({fmt_mib(need - free)} short); shorten the context or use a smaller cache dtype"
        r["total"].setText(fmt_mib(total) + verdict)
        if not budget_bytes:
            r["in_limit"].setText("no cache limit set")
        elif p.max_context_in_budget >= UNBOUNDED:
            r["in_limit"].setText(f"any length: {fmt_mib(p.kv_bytes)} of {fmt_mib(budget_bytes)} at most"
                                  + (f" ({policy} keeps {p.cache_budget:,} tokens)" if p.cache_budget else ""))
        else:
            r["in_limit"].setText(f"{p.max_context_in_budget:,} tokens in {fmt_mib(budget_bytes)}")
        if free is None:
            r["in_free"].setText("unknown")
        else:
            room = free - (0 if resident or not weights else weights)
            n = runtime.plan(layers=layers, kv_heads=kv_heads, head_dim=head_dim, cache_dtype=cdtype, context=1,
                             budget_bytes=max(room, 0), device="cpu", windows=windows, **kept).max_context_in_budget
            limit = int(m["context_limit"]) if m else None
            after = "" if resident else " after the weights" if weights else ""
            if n >= UNBOUNDED:
                r["in_free"].setText("any length" + after + (f" (the model stops at {limit:,})" if limit else ""))
            else:
                r["in_free"].setText(f"{n:,} tokens" + after
                                     + (f" (the model stops at {limit:,})" if limit and n > limit else ""))
        return p
