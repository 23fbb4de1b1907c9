"""(B15) What aligned leaf offsets cost in memory: padding bytes against data bytes.

Every leaf of a bucket starts at a multiple of ``layout.ALIGN`` = 16 elements (16 bytes in
any dtype down to fp8), zeros filling the gap after the previous leaf, so that a gathered
leaf (a view of the gathered bucket) is 16-byte aligned whatever dtype the bucket travels in
(its own, a bf16 ``param_dtype``, fp32 main grads). This benchmark measures the price: for
realistic parameter trees and every preset (on a 2x4 ``SimMesh``; the layout depends only on
the shapes, the units, the spec and the mesh's sizes), the buckets the library builds, with
their data and padding (between leaves and at the tail), against the layout before (leaves
back to back, padding at the tail only; the same packing with an alignment of 1). Two
narrower alignments are computed beside it by the same packing rule, for comparison: 4
elements (16 bytes of fp32 only: a bf16 wire of an fp32 bucket would be misaligned) and 8
(16 bytes of bf16 and up). Also counted: the leaves whose gathered offset was not 16-byte
aligned before, in fp32 and in bf16 (none is now). No collective runs: one process, host
arithmetic only (the trees' parameters are shapes on the meta device).
"""

from __future__ import annotations

import math

import torch

import functional_hsdp as fh
from functional_hsdp.plan.buckets import ALIGN, build_buckets

from .. import common as C

PROCESSES = 1
MESH = {"dp_outer": 2, "dp_inner": 4}
PRESETS = ("ddp", "fsdp", "hsdp", "hfsdp", "hsdp_shard0")
ALTERNATIVES = (4, 8)  # element alignments computed beside the library's

SIZES = {
    "tiny": {"trees": ["readme", "mlp_odd"]},
    "full": {
        "trees": [
            "readme",
            "gpt2",
            "llama_readme",
            "tinyllama_1b",
            "llama2_7b",
            "mlp_odd",
            "odd_10m",
        ]
    },
}

# Hugging Face LlamaConfig keyword arguments (shapes only: built on the meta device)
LLAMAS = {
    "llama_readme": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    ),
    "tinyllama_1b": dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4,
    ),
    "llama2_7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32,
    ),
}  # fmt: skip

TITLES = {
    "readme": "README transformer (V 256, D 64, 4 blocks)",
    "gpt2": "HF GPT-2 (124M config: biases, LayerNorms, V 50257)",
    "llama_readme": "HF Llama, the README's config (V 256, D 64, 2 layers)",
    "tinyllama_1b": "HF Llama, TinyLlama-1.1B config",
    "llama2_7b": "HF Llama, Llama-2-7B config",
    "mlp_odd": "MLP Linear(1000, 999), (999, 997), (997, 10)",
    "odd_10m": "10M odd leaves (1023 x 1024 + biases 1023/1024)",
}


def _readme(V: int, D: int, L: int) -> tuple[dict, list[int]]:
    """The README's transformer: an embedding unit, then one unit per block."""
    shapes, units = {"embed.tok": (V, D)}, [0]
    for i in range(L):
        for k, s in (("qkv", (D, 3 * D)), ("o", (D, D)), ("up", (D, 4 * D)), ("down", (4 * D, D))):
            shapes[f"blocks.{i}.{k}"] = s
            units.append(i + 1)
    return shapes, units


def _hf(name: str) -> tuple[dict, list[int]] | str:
    """A Hugging Face model's parameter shapes (a Llama of ``LLAMAS[name]``, or GPT-2's
    default config); units as ``shard_module(model, units=<its decoder layers>)``: one per
    layer, the rest the root's."""
    try:
        import transformers as tf
    except Exception as e:  # an optional dependency: the section says so
        return f"{type(e).__name__}: {e}"
    with torch.device("meta"):
        if name == "gpt2":
            model, layers = tf.GPT2LMHeadModel(tf.GPT2Config()), ["transformer", "h"]
        else:
            config = tf.LlamaConfig(**LLAMAS[name], tie_word_embeddings=False)
            model, layers = tf.LlamaForCausalLM(config), ["model", "layers"]
    shapes, units = {}, []
    for key, p in model.named_parameters():
        shapes[key] = tuple(p.shape)
        parts = key.split(".")
        units.append(1 + int(parts[2]) if parts[:2] == layers else 0)
    return shapes, units


def tree(name: str) -> tuple[dict, list[int]] | str:
    """(shapes, units) of tree ``name``, or why it cannot be built here."""
    if name == "readme":
        return _readme(256, 64, 4)
    if name == "gpt2" or name in LLAMAS:
        return _hf(name)
    if name == "mlp_odd":
        dims, shapes = (1000, 999, 997, 10), {}
        for i, (a, b) in enumerate(zip(dims, dims[1:])):
            shapes[f"{i}.weight"], shapes[f"{i}.bias"] = (b, a), (b,)
        return shapes, [i // 2 for i in range(len(shapes))]  # a unit per Linear
    shapes = C.param_tree(10_000_000, odd=True)
    return shapes, [0] * len(shapes)


def spec(preset: str) -> fh.Spec:
    mesh = fh.SimMesh(MESH)
    if preset == "hsdp_shard0":
        R, P, S = fh.Replicate(), fh.Partial("avg"), fh.Shard(0)
        return fh.Spec(mesh, [R, S], [P, S], [R, S])
    if preset in ("ddp", "fsdp"):
        return getattr(fh, preset)(mesh)
    return getattr(fh, preset)(mesh, "dp_outer", "dp_inner")


def _packed(widths: list[int], align: int, multiple: int, ranks: int) -> tuple[int, list[int]]:
    """The packing rule of ``layout.build_buckets`` at another alignment: (padded length,
    offsets). ``ranks`` > 1: a rank-major Shard(d) bucket of that many blocks."""
    up = lambda n, m: -(-n // m) * m  # noqa: E731
    offsets, end = [], 0
    for w in widths:
        offsets.append(up(end, align))
        end = offsets[-1] + w
    if ranks > 1:
        return up(end, align) * ranks, offsets
    return up(end, multiple), offsets


def measure(shapes: dict, units: list[int], preset: str) -> dict:
    """One tree under one preset: the library's buckets, and the same packing at the other
    alignments (1: the layout before)."""
    sp = spec(preset)
    n = len(shapes)
    cpu = torch.device("cpu")
    buckets, _ = build_buckets(
        tuple(shapes), shapes=tuple(shapes.values()), dtypes=(torch.float32,) * n,
        devices=(cpu,) * n, specs=(sp,) * n, units=tuple(units),
    )  # fmt: skip
    multiple = math.prod(sp.mesh.size(a) for a in sp.split_order)
    out = {"buckets": len(buckets), "data": 0, "padded": {}, "misaligned": {4: 0, 2: 0}}
    for b in buckets:
        widths = [s.width for s in b.slots]
        out["data"] += b.numel
        for align in (1, *ALTERNATIVES, ALIGN):
            padded, offsets = _packed(widths, align, multiple, b.ranks)
            out["padded"][align] = out["padded"].get(align, 0) + padded
            if align == ALIGN:  # the model of the rule is the rule
                assert (padded, offsets) == (b.padded, [s.offset for s in b.slots]), b
            if align == 1:
                block = padded // b.ranks
                for size in (4, 2):
                    out["misaligned"][size] += sum(
                        any((r * block + o) * size % 16 for r in range(b.ranks)) for o in offsets
                    )
        # in the gathered bucket: the gaps of every block (one block but for Shard(d))
        out["between"] = out.get("between", 0) + b.ranks * sum(g for g in b.after[:-1] if g)
    out["leaves"] = n
    return out


def run(size: str = "full", pool=None) -> dict:
    res = {"size": size, "cfg": SIZES[size], "trees": {}}
    for name in SIZES[size]["trees"]:
        made = tree(name)
        if isinstance(made, str):
            res["trees"][name] = {"skipped": made}
            continue
        shapes, units = made
        res["trees"][name] = {
            "params": C.numel(shapes),
            "units": len(set(units)),
            "presets": {p: measure(shapes, units, p) for p in PRESETS},
        }
    return res


def _pct(extra: int, data: int) -> str:
    return f"{100 * extra / data:.4f}"


def report(res: dict, command: str, when: str) -> str:
    head = C.section_header(
        "(B15) Alignment padding: 16-byte-aligned leaves in the gathered buckets", command, when
    )
    desc = (
        f"One process, layout arithmetic only (no collective; meta-device shapes). Mesh "
        f"{MESH['dp_outer']}x{MESH['dp_inner']}, default 25 MiB buckets, one unit per layer "
        "(as `shard_module(units=layers)`: a bucket never spans units); `hsdp_shard0` is hsdp "
        "with `Shard(0)` for Flat (FSDP2's layout). *Data*: fp32 parameters of the tree "
        "(elements x 4 bytes; the layout is the same in any dtype, so the percentages are "
        "too). *Before*: leaves back to back, padding at the tail only (Shard(0): the chunks' "
        "own padding). *Now*: every leaf at a multiple of 16 elements (`layout.ALIGN`); "
        "*between* is the part of it between leaves. *Added*: now minus before, in % of the "
        "data. *4 el.* / *8 el.*: what the same rule would add aligning to 4 elements (16 "
        "bytes of fp32 only) or 8 (of bf16). *Misaligned before*: leaves whose offset in the "
        "gathered bucket (any block of a Shard(0) bucket) was not a multiple of 16 bytes, in "
        "fp32 / bf16 (none now).\n"
    )
    rows, skipped, worst = [], [], 0.0
    for name, t in res["trees"].items():
        if "skipped" in t:
            skipped.append(f"- {TITLES[name]}: skipped ({t['skipped']}).")
            continue
        for preset, m in t["presets"].items():
            pad = {a: p - m["data"] for a, p in m["padded"].items()}
            added = (pad[ALIGN] - pad[1]) / m["data"]
            worst = max(worst, added)
            named = f"{TITLES[name]}; {t['params']:,} params, {m['leaves']} leaves"
            rows.append(
                [
                    named if preset == PRESETS[0] else "",  # the tree on its first row only
                    preset,
                    m["buckets"],
                    C.mib(4 * m["data"]),
                    f"{4 * pad[1]:,}",
                    f"{4 * pad[ALIGN]:,}",
                    f"{4 * m['between']:,}",
                    _pct(pad[ALIGN] - pad[1], m["data"]),
                    *(_pct(pad[a] - pad[1], m["data"]) for a in ALTERNATIVES),
                    f"{m['misaligned'][4]} / {m['misaligned'][2]}",
                ]
            )
    table = C.table(
        [
            "tree",
            "preset",
            "buckets",
            "data (MiB)",
            "padding before (bytes)",
            "padding now (bytes)",
            "of which between leaves",
            "added (% of data)",
            "4 el. (%)",
            "8 el. (%)",
            "misaligned before fp32 / bf16",
        ],
        rows,
    )
    verdict = (
        f"\nLargest added padding: {100 * worst:.4f} % of the data: the gathered buckets, so "
        "the all-gathers' bytes and the shards' memory, grow by at most this fraction.\n"
    )
    return head + "\n" + desc + "\n" + table + "\n" + "\n".join(skipped) + verdict
