"""IPython start-up for code-interpreter kernels: E2B's extra MIME types.

Adds two display formatters, registered by type *name* so that neither pandas nor matplotlib is
imported until user code imports it (kernels start faster):
- `e2b/data`: a pandas DataFrame as {column: [values…]}, JSON-safe (NaN → null, times ISO-8601).
- `e2b/chart`: a matplotlib Figure as the SDK's chart model (e2b_charts, E2B's own extractor).
Matplotlib figures already render as PNG through ipykernel's inline backend.
"""


def _e2b_register_formatters() -> None:
    import json

    from IPython import get_ipython
    from IPython.core.formatters import JSONFormatter
    from traitlets import ObjectName, Unicode

    shell = get_ipython()
    if shell is None:
        return

    class E2BDataFormatter(JSONFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")

    class E2BChartFormatter(JSONFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")

    def dataframe_to_data(df):
        # to_json does the JSON-safety (numpy scalars, NaN, timestamps); split keeps column order.
        split = json.loads(df.to_json(orient="split", date_format="iso", default_handler=str))
        columns = [str(c) for c in split["columns"]]
        rows = split["data"]
        return {col: [row[i] for row in rows] for i, col in enumerate(columns)}

    def figure_to_chart(figure):
        try:
            from e2b_charts import chart_figure_to_dict

            return chart_figure_to_dict(figure) or None
        except Exception:  # a figure the extractor does not understand still shows as PNG
            return None

    data = E2BDataFormatter(parent=shell.display_formatter)
    data.for_type_by_name("pandas.core.frame", "DataFrame", dataframe_to_data)
    chart = E2BChartFormatter(parent=shell.display_formatter)
    chart.for_type_by_name("matplotlib.figure", "Figure", figure_to_chart)
    shell.display_formatter.formatters["e2b/data"] = data
    shell.display_formatter.formatters["e2b/chart"] = chart


_e2b_register_formatters()
del _e2b_register_formatters
