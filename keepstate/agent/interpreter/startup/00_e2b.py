"""IPython start-up for code-interpreter kernels: E2B's extra MIME types.

Adds two display formatters, registered by type *name* so that neither pandas nor matplotlib is
imported until user code imports it (kernels start faster):
- `e2b/data`: a pandas DataFrame as {column: [values…]}, JSON-safe (NaN → null, times ISO-8601).
- `e2b/chart`: a matplotlib Figure as the SDK's chart model (e2b_charts, E2B's own extractor),
  recognised without importing matplotlib.
Matplotlib figures already render as PNG through ipykernel's inline backend. A PIL image's `show()` and `save()`
display it too, as E2B's kernels do.
"""


def _e2b_register_formatters() -> None:
    import json
    import sys
    from typing import Any

    from IPython import get_ipython
    from IPython.core.formatters import JSONFormatter
    from traitlets import ObjectName, Unicode

    shell = get_ipython()
    if shell is None:
        return

    # IPython and traitlets ship no types (installed only in the code interpreter's image): its classes are Any.
    class E2BDataFormatter(JSONFormatter):  # type: ignore[misc]
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")

    class E2BChartFormatter(JSONFormatter):  # type: ignore[misc]
        # Not a type registration: activating the inline backend pops every Figure printer
        # from every formatter (IPython's select_figure_formats).
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")

        def __call__(self, obj: Any) -> Any:
            # The module may still be initialising on warm.py's import thread: no Figure yet.
            figure_type = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
            if self.enabled and isinstance(figure_type, type) and isinstance(obj, figure_type):
                return figure_to_chart(obj)
            return super().__call__(obj)

    def dataframe_to_data(df: Any) -> dict[str, list[Any]]:
        # to_json does the JSON-safety (numpy scalars, NaN, timestamps); split keeps column order.
        split = json.loads(df.to_json(orient="split", date_format="iso", default_handler=str))
        columns = [str(c) for c in split["columns"]]
        rows = split["data"]
        return {col: [row[i] for row in rows] for i, col in enumerate(columns)}

    def plain(value: Any) -> Any:
        if hasattr(value, "tolist"):
            return value.tolist()
        raise TypeError(f"{type(value).__name__} is not JSON serializable")

    def figure_to_chart(figure: Any) -> Any:
        try:
            from e2b_charts import chart_figure_to_chart

            chart = chart_figure_to_chart(figure)
            if chart is None:
                return None
            # Extracted values can be numpy scalars (e.g. box plots of int data): make them plain JSON.
            return json.loads(json.dumps(chart.model_dump(), default=plain))
        except Exception:  # a figure the extractor does not understand still shows as PNG
            return None

    data = E2BDataFormatter(parent=shell.display_formatter)
    # pandas ≥ 3 reports DataFrame's module as `pandas`, older versions as `pandas.core.frame`.
    data.for_type_by_name("pandas", "DataFrame", dataframe_to_data)
    data.for_type_by_name("pandas.core.frame", "DataFrame", dataframe_to_data)
    chart = E2BChartFormatter(parent=shell.display_formatter)
    shell.display_formatter.formatters["e2b/data"] = data
    shell.display_formatter.formatters["e2b/chart"] = chart
    # active_types is fixed when the shell starts; new formatters are skipped unless added to it.
    for mime in ("e2b/data", "e2b/chart"):
        if mime not in shell.display_formatter.active_types:
            shell.display_formatter.active_types.append(mime)


def _e2b_pil_displays() -> None:
    """As E2B's kernels: a PIL image's `show()` displays it, and so does its `save()` (after saving), so both come
    back as a PNG result. Patched when PIL.Image is first imported, not before: kernels start no slower."""
    import sys
    from importlib.abc import MetaPathFinder
    from importlib.machinery import ModuleSpec, PathFinder
    from types import ModuleType
    from typing import Any

    def patch(module: ModuleType) -> None:
        import os
        import threading

        from IPython.display import display

        image_class = module.Image
        saving = image_class.save
        shown = threading.local()  # displaying renders the PNG with save(): not displayed again from in there

        def show_once(image: Any) -> None:
            if getattr(shown, "now", False):
                return
            shown.now = True
            try:
                display(image)
            finally:
                shown.now = False

        def show(self: Any, *args: Any, **kwargs: Any) -> None:
            show_once(self)

        def save(self: Any, fp: Any, *args: Any, **kwargs: Any) -> Any:
            done = saving(self, fp, *args, **kwargs)
            # Into a file: shown too. Not into a buffer (a PNG being rendered), nor matplotlib's savefig (the
            # figure is shown as itself, with its chart).
            caller = str(sys._getframe(1).f_globals.get("__name__", ""))
            if isinstance(fp, (str, os.PathLike)) and not caller.startswith("matplotlib"):
                show_once(self)
            return done

        image_class.show, image_class.save = show, save

    if "PIL.Image" in sys.modules:
        patch(sys.modules["PIL.Image"])
        return

    class PatchOnImport(MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> ModuleSpec | None:
            if name != "PIL.Image":
                return None
            sys.meta_path.remove(self)
            spec = PathFinder.find_spec(name, path)
            loader = spec.loader if spec is not None else None
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            run = loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                patch(module)

            loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, PatchOnImport())


_e2b_register_formatters()
del _e2b_register_formatters
_e2b_pil_displays()
del _e2b_pil_displays
