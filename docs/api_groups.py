"""The API reference's groups: every name of ``functional_hsdp.__all__`` in exactly one.

The reference pages are generated from this mapping (``docs/conf.py``), and
``tests/project/test_docs.py`` fails while a public name is in no group, or in two: a name
added to ``__all__`` gets its page by being added here, under the group a reader would look in.
"""

from __future__ import annotations

# group title -> (page slug, one line on what the group is for, names in reading order)
# fmt: off
GROUPS: dict[str, tuple[str, str, list[str]]] = {
    "Placements and specs": (
        "placements",
        "Where a value lives on each mesh axis, the three placements of a spec, and what a "
        "spec's axes do: replicas that train apart, a compressed outer reduction.",
        ["Placement", "Replicate", "Partial", "Flat", "Shard", "Owner",
         "Spec", "ddp", "fsdp", "hsdp", "hfsdp", "owned", "replicas", "compress", "Compress"],
    ),
    "Meshes": (
        "meshes",
        "Named data-parallel axes: simulated in one process, or real ranks; a replica axis "
        "whose groups may fail (torchft's quorums, or a simulated schedule).",
        ["Mesh", "SimMesh", "DistMesh", "per_rank", "fault_tolerant", "simulated_quorum"],
    ),
    "Collectives": (
        "collectives",
        "Per-axis bucketed collectives with JAX's names, and the log of what was issued.",
        ["psum", "pmean", "psum_scatter", "all_gather", "compressed_all_reduce",
         "comm_log", "CommLog", "Event"],
    ),
    "Gradients": (
        "gradients",
        "Reducing and accumulating gradients, whole trees and persistent buffers.",
        ["reduce_grads", "shard", "gather", "sync_params", "MainGrad", "microbatches",
         "grad", "grad_and_value", "per_example_grad_norms", "ghost_grad_norms",
         "ghost_clipped_grad"],
    ),
    "Units and modules": (
        "units",
        "Layer-wise training: units gathered inside the loss, and existing nn.Modules.",
        ["gathered", "Gathered", "sequence", "shard_module", "functional_call"],
    ),
    "Optimizers": (
        "optimizers",
        "optax-style optimizers and combinators on sharded trees, learning-rate schedules, "
        "global norms, matrix optimizers, and DiLoCo's outer loop.",
        ["GradientTransformation", "sgd", "SGDState", "adamw", "apply_updates",
         "chain", "scale", "scale_by_adam", "add_decayed_weights", "scale_by_learning_rate",
         "clip_global_norm", "ChainState", "EmptyState", "ScaleByAdamState",
         "ScaleByLearningRateState", "schedules",
         "global_norm", "clip_by_global_norm", "add_gaussian_noise", "gaussian_noise",
         "AddGaussianNoiseState", "per_matrix", "newton_schulz", "muon",
         "MuonState", "partition", "PartitionState", "MaskedNode", "masked_node",
         "diloco", "DiLoCo", "DiLoCoState", "sync_steps",
         "balanced_fragments"],
    ),
    "Checkpoints": (
        "checkpoints",
        "Mesh-independent checkpoints through torch.distributed.checkpoint, and DTensors.",
        ["state_dict", "empty_state_dict", "load_state_dict", "to_dtensor"],
    ),
    "Checks": (
        "checks",
        "The cross-rank agreement, collective failures, and what the library remembers.",
        ["validation", "CollectiveError", "clear_caches"],
    ),
}
# fmt: on


def problems(public: list[str]) -> list[str]:
    """What is wrong with :data:`GROUPS` for the public names ``public``: each line names a
    name in no group, in several, or in a group but not public. Empty when all is well."""
    seen: dict[str, list[str]] = {}
    for title, (_, _, names) in GROUPS.items():
        for name in names:
            seen.setdefault(name, []).append(title)
    out = [
        f"{name!r} is in functional_hsdp.__all__ but in no group of docs/api_groups.py: "
        "add it to the group a reader would look in"
        for name in public
        if name not in seen
    ]
    out += [
        f"{name!r} is in several groups of docs/api_groups.py: {titles}"
        for name, titles in seen.items()
        if len(titles) > 1
    ]
    out += [
        f"{name!r} is in docs/api_groups.py ({titles[0]}) but not in functional_hsdp.__all__"
        for name, titles in seen.items()
        if name not in public
    ]
    return out
