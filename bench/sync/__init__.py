"""Benchmarks of the sync layer: an HSDP step against FSDP2 (``fsdp``), ``reduce_grads`` against
bare collectives (``limit``), scaling (``scaling``), peak memory (``memory``) and
``torch.compile`` (``compiled``)."""
