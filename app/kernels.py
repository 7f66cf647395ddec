"""Every compiled pass of the decision core, compiled ahead: `python -m app.kernels`.

The routing passes (numba, `cache=True`) compile on first use and keep the machine code
beside their modules; `make install` runs this module so that neither a request nor a
test pays the compile on a fresh checkout. Each module's own `warm_up` (called where
its objects are built) then only loads the cached code.
"""

from __future__ import annotations

import time


def compile_all() -> float:
    """Compile (or load) every pass; the seconds it took."""
    from app.engines import prefix
    from app.routing import length, status
    from app.routing.goodserve import scoring, watchdog
    from app.routing.quantiles import SortedWindow
    from predictor import features

    start = time.perf_counter()
    for warm_up in (prefix.warm_up, status.warm_up, scoring.warm_up, watchdog.warm_up,
                    length.warm_up, features.warm_up):
        warm_up()
    SortedWindow(1)
    return time.perf_counter() - start


if __name__ == "__main__":
    print(f"compiled the decision core's passes in {compile_all():.1f} s")
