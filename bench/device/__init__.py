"""The one-device check (``gpu``): every library path at world size 1, on a GPU where there
is one, with its Hugging Face (``gpu_hf``) and Muon (``gpu_muon``) parts."""
