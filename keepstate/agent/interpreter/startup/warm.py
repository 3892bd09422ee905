"""IPython start-up for the default Python context: import the data stack in the background.

numpy, pandas and matplotlib take seconds to import under gVisor; nearly every session imports
them. Importing them on a thread lets the kernel answer its first execution at once, and makes
the user's own `import pandas` find them loaded (or wait for the import already under way).
pyplot is left out: importing it activates IPython's inline backend, which belongs on the
kernel's main thread.
"""


def _keepstate_warm() -> None:
    import importlib
    import threading

    def load() -> None:
        for name in ("numpy", "pandas", "matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
            try:
                importlib.import_module(name)
            except Exception:  # a broken package shows up when user code imports it, not here
                return

    threading.Thread(target=load, name="keepstate-warm-imports", daemon=True).start()


_keepstate_warm()
del _keepstate_warm
