"""Benchmarks of the optim layer: matrix optimizers, Muon on the owner placement (``muon``)."""
