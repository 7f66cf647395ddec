"""Engine backends (simulated and vLLM), their configuration (`config`), the messages
they exchange with router and simulator (`messages`), the prefix index and the tiny
local test model (`tiny_model`), Ray-free.

`deployments/engine.py` wraps a backend in a Ray actor; the discrete-event simulator
and the live router import the prefix index from here. Submodules are imported
directly (`app.engines.sim`, `app.engines.vllm`, ...) so that this package stays
cheap to import and free of cycles with `app.sim`.
"""
