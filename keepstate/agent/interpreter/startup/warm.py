"""IPython start-up for the default Python context: import the data stack before the first execution.

numpy, pandas and matplotlib take seconds to import under gVisor and nearly every session imports
them. They are imported here, on the kernel's main thread, while the sandbox is still in the warm
pool, so a pooled sandbox's first `import pandas` is instant. (An earlier version imported them on a
background thread; user code importing the same modules at the same moment could hang the kernel.)
pyplot is left out: importing it activates IPython's inline backend, which user code should choose.
"""


def _keepstate_warm() -> None:
    import importlib

    for name in ("numpy", "pandas", "matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        try:
            importlib.import_module(name)
        except Exception:  # a broken package shows up when user code imports it, not here
            return


_keepstate_warm()
del _keepstate_warm
