"""Engine backends (simulated and vLLM) and the prefix index, Ray-free.

`deployments/engine.py` wraps a backend in a Ray actor; the discrete-event simulator
and the live router import the prefix index from here. Submodules are imported
directly (`app.engines.sim`, `app.engines.vllm`, ...) so that this package stays
cheap to import and free of cycles with `app.sim`.
"""
