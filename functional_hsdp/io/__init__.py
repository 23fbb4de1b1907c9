"""The io layer: checkpoints in a mesh-independent per-leaf form (DCP, resharding).

It sits below every stateful type: each says how it is saved and loaded where it is defined,
with this layer's helpers, so the checkpoint room names none of them.
"""
