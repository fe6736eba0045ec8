"""How the model's weights are held: "full" (as loaded, in its dtype), "packed" or "int8".

packed is the full fp32 weights in oneDNN's blocked layout, for the CPU's products. torch's
`nn.Linear` multiplies through MKL, whose products of a few rows (decode steps) read the weight
far below the memory's speed on this AVX2 host; oneDNN's kernel on a weight laid out for it ahead
reads it at that speed. The 28 layers' products at Qwen3-0.6B's shape, 2 cores of an AMD EPYC
(Zen 3, AVX2), distinct weights for each layer (`python -m benchmarks.weights` says how to run it
again): 1 row 98 ms as `nn.Linear`, 70 ms packed; 2 rows 188 / 77; 4 rows 239 / 85; 8 rows
217 / 119; 64 rows 518 / 434; 280 rows (a prompt) 1,670-1,930 / 1,718-2,003, a tie within this
host's noise. The values are the same fp32 weights; the sums run in oneDNN's order, so outputs
differ from `nn.Linear`'s by float noise (a few ulps), and from one row count to another.

int8 is weight-only: every linear layer of the decoder and the output head keeps its weight as
int8 levels with one bf16 scale per output channel (weight ≈ level × scale). Inputs are not
rounded to 8 bits: each product takes its input in bf16, sums in fp32 and gives bf16, which is
what torch's weight-only int8 kernel on the CPU does (`aten._weight_int8pack_mm`, gpt-fast's and
torchao's CPU path). On a CPU a decode step is bound by reading the weights, and that kernel reads
the int8 bytes as they lie: a quarter of fp32's (`python -m benchmarks.weights`). It is a
matrix-vector kernel (it re-reads the weight for every 4 rows), so a product of more than
`KERNEL_ROWS` rows, a prompt's, multiplies by the weight turned into fp32 for the call instead,
with the same operands and roundings: the two differ by the order of fp32 sums only. Or, where
the CPU multiplies bf16 natively (timed when the weights are made int8: `choose_prompt_kernel`,
shown in /status), by the levels turned into bf16 (exact: integers to 127), each sum rounded to
bf16 before its scale as well as after (one bf16 step at most).

Norms, embeddings, attention and the KV cache stay in the model's dtype. Activations in bf16 keep
8 significant bits per value whatever the others in the token are, so channels of outsized values
(real checkpoints have them) cost no precision to the rest, as a per-token int8 scale did (this
module's earlier design, `torch._int_mm`, which also ran as compute, not as a read, on CPUs
without VNNI: 27x slower than fp32 for a 512-token prompt on such a host).

Rollback for the model as quantized: the operands of each token's products are rounded on their
own, but sums run in floats whose order depends on the batch, the chunk and the kernel, and each
output is rounded to bf16: a value a hair from a rounding boundary can then round the other way.
So what the tests hold is: each reply token is the top one of a from-scratch forward of the same
quantized model, or within 0.1 of it (tests/reference.py, `check_near_greedy`), and the cached
states give that forward's logits within 0.1 on their random models (not bit for bit). Greedy replies differ from the full model's where the rounding moves a near-tie: the
benchmark reports how often, on the trained demo model.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

from chat.model_step.resident import recurrent_mixers

WEIGHT_FORMATS = ("auto", "full", "packed", "int8")


@torch.library.custom_op("rewind_chat::packed_linear", mutates_args=())
def packed_linear(hidden: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`hidden` times a weight packed by `mkldnn._reorder_linear_weight`. An op of its own for
    `torch.compile`: inductor's own lowering of the oneDNN product expects the weights it packed
    itself (its freezing pass), so the compiled step calls this as an opaque kernel."""
    return torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), packed, None, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(hidden: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return hidden.new_empty((*hidden.shape[:-1], packed.shape[0]))


class PackedLinear(nn.Module):
    """`nn.Linear` with its fp32 weight in oneDNN's blocked layout (same values, other sum order).
    The packed tensor has no storage torch can save or share: it lives in this layer only (a
    buffer outside the state dict)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_packed", torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach().float().contiguous()), persistent=False)
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            out = packed_linear(hidden, self.weight_packed)
        else:  # the op itself: no custom-op dispatch on every eager product
            out = torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), self.weight_packed, None, "none", [], "")
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp32 weights packed for oneDNN"


def one_row_product(row: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """One row times int8 `levels` (out, in) and their per-channel `scales`, written as the sum it
    is so that inductor makes it one fused loop: each weight byte is read once, widened in
    registers and summed in fp32 (no fp32 copy of the weight is made: traced, never run eagerly).
    The compiled one-row step's products: in one graph at Qwen3-0.6B's shape (the 28 layers and
    the head, distinct weights, 2 AVX-512 cores) 26.3 ms against 38.1 for `_weight_int8pack_mm`
    called from the graph, 22.6 GB/s of weights read against 15.7; with 2 or more rows it re-reads
    the weight for each and loses (50 against 45 ms at 2 rows), so only one-row graphs take it.

    The row is not rounded to bf16, nor the output: inductor drops such a round trip inside a
    fused loop anyway (its `emulate_precision_casts` is off), so the product is what it says, the
    row as the model holds it (fp32 for an fp32 model: nearer the full model than the eager
    kernel's bf16 input) times the int8 weight, summed and given in fp32 (the model's dtype after)."""
    out = (row.float()[:, None, :] * levels.float()).sum(-1) * scales.float()
    out = out if bias is None else out + bias.float()
    return out.to(row.dtype)


class Int8Linear(nn.Module):
    """`nn.Linear` with int8 weights (a bf16 scale per output channel) and bf16 inputs."""

    # Up to this many rows the weight-only kernel is the faster (measured at Qwen3-0.6B's shape on
    # 2 AVX2 cores, the 28 layers' products: 1 row 48 ms against fp32's 126, 16 rows 311 against
    # 349, 32 rows 585 against 426); more rows are compute, where fp32's is best.
    KERNEL_ROWS = 16

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.bfloat16).tiny) / 127.0).to(torch.bfloat16)
        levels = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", levels.contiguous())  # (out, in), as the kernel reads it
        self.register_buffer("scales", scales)
        self.bias = linear.bias
        # The kernel loads 8 (AVX2) or 16 (AVX-512) inputs at a time from aligned addresses and has
        # no tail: other widths take the fp32 path whatever the rows.
        self.kernel_fits = self.in_features % 16 == 0

    # How a product of more than KERNEL_ROWS rows runs (`PROMPT_KERNELS`): set on a model's layers
    # by `apply_weight_format`, as `choose_prompt_kernel` timed it on this host.
    prompt_kernel = "fp32"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features)
        if rows.shape[0] == 1 and torch.compiler.is_compiling():
            return one_row_product(rows, self.weight_int8, self.scales, self.bias).reshape(
                *hidden.shape[:-1], self.out_features)
        # A fresh bf16 copy: contiguous and aligned, as the kernel's aligned loads need.
        flat = rows.to(torch.bfloat16, copy=True)
        if self.kernel_fits and flat.shape[0] <= self.KERNEL_ROWS:
            out = torch._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        else:
            out = self.prompt_product(flat, self.prompt_kernel)
        out = out.to(hidden.dtype).reshape(*hidden.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def prompt_product(self, flat: torch.Tensor, kernel: str) -> torch.Tensor:
        """`flat` (bf16 rows) times the weight, as `kernel` says: "fp32" turns the levels into fp32
        and sums in fp32; "bf16" turns them into bf16 (integers to 127 are exact there) and lets
        the CPU's bf16 product sum them (fp32 sums, but a partial sum may be rounded to bf16 between
        blocks of the inner dimension: each output lies within one bf16 step of the sum of its
        terms' magnitudes, not of its value, tests/test_weights.py)."""
        if kernel == "bf16":
            return (nn.functional.linear(flat, self.weight_int8.to(torch.bfloat16)).float()
                    * self.scales.float()).to(torch.bfloat16)
        return (nn.functional.linear(flat.float(), self.weight_int8.float()) * self.scales.float()).to(torch.bfloat16)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, bf16 inputs"


def products_keep_rows_apart(model: nn.Module) -> bool:
    """Whether every product of `model` gives a row the same bits whatever rows are beside it (up
    to `Int8Linear.KERNEL_ROWS` rows): int8 weights, whose weight-only kernel sums each row alone
    (tests/test_weights.py holds it). MKL's and oneDNN's fp32 products block the rows and give a
    row of several other bits than the row alone (float noise, where int8's bf16 outputs can round
    a near-tie the other way)."""
    linears = [module for module in model.modules() if isinstance(module, (nn.Linear, PackedLinear, Int8Linear))]
    return bool(linears) and all(isinstance(module, Int8Linear) and module.kernel_fits for module in linears)


PROMPT_KERNELS = ("fp32", "bf16")
PROMPT_PROBE_ROWS = 256  # a prompt piece's rows, as the choice is timed
_PROMPT_CHOICE: dict[str, object] = {}  # what `choose_prompt_kernel` measured and chose, for /status


@torch.no_grad()
def choose_prompt_kernel(layer: Int8Linear, repeats: int = 5) -> dict[str, object]:
    """Time each of `PROMPT_KERNELS` on `layer` for a `PROMPT_PROBE_ROWS`-row product (the median of
    `repeats`, after one untimed call each) and have every int8 layer use the faster, once a
    process: which is faster is a property of the CPU (on 2 cores with avx512_bf16, 256 rows of
    Qwen3-0.6B's 1,024 x 3,072 layer: 10.1 ms fp32, 4.6 ms bf16; a 512-token prompt 2.05x faster
    whole, `benchmarks/prompt_kernels.py`; without avx512_bf16 the bf16 product is emulated).
    Both have the same operands; "bf16" may round partial sums to bf16 (see `prompt_product`).
    Returns what was measured (also in `prompt_kernel_choice()`, for /status)."""
    if _PROMPT_CHOICE:
        return dict(_PROMPT_CHOICE)
    flat = torch.randn(PROMPT_PROBE_ROWS, layer.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    timings = {kernel: round(_median_ms(lambda: layer.prompt_product(flat, kernel), repeats), 3)
               for kernel in PROMPT_KERNELS}
    chosen = min(timings, key=timings.__getitem__)
    _PROMPT_CHOICE.update(chosen=chosen, ms=timings, rows=PROMPT_PROBE_ROWS,
                          shape=[layer.out_features, layer.in_features])
    return dict(_PROMPT_CHOICE)


def _median_ms(product: Callable[[], object], repeats: int) -> float:
    """The median milliseconds of `repeats` calls of `product`, after one untimed (a first call
    may allocate): how this module times a kernel."""
    product()
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        product()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs) * 1000


def prompt_kernel_choice() -> dict[str, object] | None:
    """What `choose_prompt_kernel` chose and measured in this process (None: no int8 model yet)."""
    return dict(_PROMPT_CHOICE) if _PROMPT_CHOICE else None


# "auto": the rows it times a product at (decode steps of one and four conversations, a prompt piece)
AUTO_PROBE_ROWS = (1, 4, 64)
AUTO_PROMPT_SLACK = 1.15  # packed is taken only if its prompt-piece product is at most this much slower
_WEIGHT_CHOICES: dict[tuple[int, int], dict[str, object]] = {}  # by the layer shape timed, once a process


@torch.no_grad()
def choose_weight_format(model: PreTrainedModel, repeats: int = 7) -> dict[str, object]:
    """"auto": "full" or "packed", whichever this host multiplies faster, timed once a process
    for each shape on the model's widest decoder layer (the output head aside). Packed is taken where its products
    of 1 and 4 rows (decode steps) take less time together and its 64-row product (a prompt
    piece) is at most `AUTO_PROMPT_SLACK` slower: at Qwen3-0.6B's shape on this session's
    AVX-512 host, a decode step of four conversations took 174 ms packed against 350 as loaded,
    one conversation's 142 against 150 (`python -m benchmarks.step_anatomy --weights ...`,
    docs/performance.md); on an AVX2 host 85 against 239 and 70 against 98 for the 28 layers'
    products. Never int8, which changes the model's numbers beyond float noise (asked for by
    name). Returns what was measured (the engine shows it in /status)."""
    refusal = _packed_refusal(model)
    if refusal is not None:
        return {"chosen": "full", "because": refusal}
    head = model.get_output_embeddings()
    linears = [module for module in model.modules() if type(module) is nn.Linear and module is not head]
    if not linears:
        return {"chosen": "full", "because": "no linear layer to time"}
    widest = max(linears, key=lambda module: module.in_features * module.out_features)
    shape = (widest.out_features, widest.in_features)
    if shape in _WEIGHT_CHOICES:
        return dict(_WEIGHT_CHOICES[shape])
    packed = PackedLinear(widest)
    timings: dict[str, dict[str, float]] = {"full": {}, "packed": {}}  # by rows, as text (/status is JSON)
    for rows in AUTO_PROBE_ROWS:
        hidden = torch.randn(rows, widest.in_features, generator=torch.Generator().manual_seed(rows))
        for name, layer in (("full", widest), ("packed", packed)):
            timings[name][str(rows)] = round(_median_ms(lambda: layer(hidden), repeats), 4)
    decode = {name: sum(timings[name][str(rows)] for rows in AUTO_PROBE_ROWS[:2]) for name in timings}
    prompt_rows = str(AUTO_PROBE_ROWS[-1])
    faster = decode["packed"] < decode["full"] and \
        timings["packed"][prompt_rows] <= AUTO_PROMPT_SLACK * timings["full"][prompt_rows]
    _WEIGHT_CHOICES[shape] = dict(chosen="packed" if faster else "full", ms=timings, shape=list(shape))
    return dict(_WEIGHT_CHOICES[shape])


def _packed_refusal(model: PreTrainedModel) -> str | None:
    """Why `model`'s weights cannot be packed here (None: they can)."""
    if model.device.type != "cpu":
        return f"packed weights are for the CPU; this model is on {model.device.type}"
    if model.dtype != torch.float32:
        return f"packed weights take a float32 model, not {model.dtype}"
    if not torch.backends.mkldnn.is_available():
        return "packed weights need torch built with oneDNN (mkldnn), which this one is not"
    return None


def resolve_weight_format(model: PreTrainedModel, weights: str) -> str:
    """The format `weights` means for this model: "auto" chosen by timing, the others as they are."""
    check_weight_format(weights)
    return str(choose_weight_format(model)["chosen"]) if weights == "auto" else weights


def check_weight_format(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights is one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")


@torch.no_grad()
def apply_weight_format(model: PreTrainedModel, weights: str) -> PreTrainedModel:
    """Hold `model`'s weights as `weights` says (in place; again on a quantized model: no change;
    "auto": as `choose_weight_format` times it on this host, and an output head that shares the
    token embedding's weight stays as loaded, where its own packed copy would hold that weight
    twice: 594 MiB more at Qwen3-0.6B's vocabulary, and a default must not grow a model by a
    third; asked by name, every linear layer is converted)."""
    keep_tied_head = weights == "auto"
    weights = resolve_weight_format(model, weights)
    if weights == "full":
        return model
    if model.device.type != "cpu":
        raise ValueError(f"{weights} weights are measured on the CPU only; on a GPU load bf16 (--dtype bfloat16)")
    if weights == "packed":
        refusal = _packed_refusal(model)
        if refusal is not None:
            raise ValueError(refusal)
        layer: type[nn.Module] = PackedLinear
    else:
        if model.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"int8 weights take a float32 or bfloat16 model, not {model.dtype}")
        layer = Int8Linear
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = embedding is not None and getattr(head, "weight", None) is embedding.weight  # (a packed head has none)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and not (keep_tied_head and tied and child is head):
                setattr(parent, name, layer(child))
    if layer is Int8Linear:
        set_prompt_kernel(model)
    return model


def set_prompt_kernel(model: PreTrainedModel) -> str:
    """Give `model`'s int8 layers the prompt product this host runs fastest (timed once a process
    on its widest layer), except a model with recurrent layers (linear attention, state spaces):
    they fold every token's error into their state, and "bf16" moved the tiny test model's logits
    by up to 1.0 against 0.1 with attention alone, so they keep "fp32". Returns the kernel set."""
    layers = [module for module in model.modules() if isinstance(module, Int8Linear)]
    named = set(getattr(model.config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    kernel = "fp32"
    if layers and not named and not recurrent_mixers(model):  # (the mixers packed steps run per row)
        widest = max(layers, key=lambda module: module.in_features * module.out_features)
        kernel = str(choose_prompt_kernel(widest).get("chosen", "fp32"))
    for module in layers:
        module.prompt_kernel = kernel
    return kernel
