"""Display data, PNGs, DataFrames and charts (the template's IPython start-up script)."""

from __future__ import annotations

import base64
from collections.abc import Callable

from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import (
    BarChart,
    BoxAndWhiskerChart,
    ChartType,
    LineChart,
    PieChart,
    ScatterChart,
    SuperChart,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_display_data(sandbox: Sandbox) -> None:
    execution = sandbox.run_code(
        "from IPython.display import display, HTML, Markdown\n"
        "display(HTML('<b>bold</b>'))\ndisplay(Markdown('# title'))\n42"
    )
    html, markdown, main = execution.results
    assert html.html == "<b>bold</b>" and not html.is_main_result
    assert markdown.markdown == "# title"
    assert main.is_main_result and main.text == "42"


def test_extra_mime_types_go_to_extra(sandbox: Sandbox) -> None:
    execution = sandbox.run_code(
        "from IPython.display import display\n"
        "display({'application/x-custom': 'v', 'text/plain': 'p'}, raw=True)"
    )
    assert execution.results[0].extra == {"application/x-custom": "v"}
    assert execution.results[0].text == "p"


def test_matplotlib_png(sandbox: Sandbox) -> None:
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
    )
    pngs = [r.png for r in execution.results if r.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(PNG_MAGIC)


def test_dataframe_data(sandbox: Sandbox) -> None:
    execution = sandbox.run_code(
        "import pandas as pd, numpy as np\n"
        "pd.DataFrame({'a': [1, 2], 'b': ['x', None], 'c': [0.5, np.nan],"
        " 't': pd.to_datetime(['2024-01-02', '2024-03-04'])})"
    )
    result = execution.results[0]
    assert result.is_main_result
    assert result.html is not None and "<table" in result.html
    assert result.data["a"] == [1, 2]
    assert result.data["b"] == ["x", None]
    assert result.data["c"] == [0.5, None]
    assert result.data["t"][0].startswith("2024-01-02")


def _chart(sandbox: Sandbox, code: str):
    execution = sandbox.run_code("import matplotlib.pyplot as plt\n" + code + "\nplt.show()")
    assert execution.error is None, execution.error
    charts = [r.chart for r in execution.results if r.chart]
    assert len(charts) == 1, execution.results
    return charts[0]


def test_bar_chart(sandbox: Sandbox) -> None:
    chart = _chart(sandbox, "plt.bar(['A', 'B', 'C'], [10, 20, 15])\nplt.title('Sales')\n"
                            "plt.xlabel('Product')\nplt.ylabel('Units')")
    assert isinstance(chart, BarChart) and chart.type == ChartType.BAR
    assert chart.title == "Sales" and chart.x_label == "Product" and chart.y_label == "Units"
    assert [(e.label, e.value) for e in chart.elements] == [("A", 10), ("B", 20), ("C", 15)]


def test_line_chart(sandbox: Sandbox) -> None:
    chart = _chart(sandbox, "plt.plot([0, 1, 2], [0, 1, 4], label='sq')\nplt.title('Line')")
    assert isinstance(chart, LineChart)
    assert chart.title == "Line"
    assert chart.elements[0].label == "sq"
    assert [tuple(map(float, p)) for p in chart.elements[0].points] == [(0, 0), (1, 1), (2, 4)]


def test_scatter_chart(sandbox: Sandbox) -> None:
    chart = _chart(sandbox, "plt.scatter([1, 2, 3], [3, 2, 1], label='pts')")
    assert isinstance(chart, ScatterChart)
    assert [tuple(map(float, p)) for p in chart.elements[0].points] == [(1, 3), (2, 2), (3, 1)]


def test_pie_chart(sandbox: Sandbox) -> None:
    chart = _chart(sandbox, "plt.pie([1, 3], labels=['one', 'three'])\nplt.title('Pie')")
    assert isinstance(chart, PieChart)
    assert [e.label for e in chart.elements] == ["one", "three"]
    assert sum(e.angle for e in chart.elements) == 360


def test_box_and_whisker_chart(sandbox: Sandbox) -> None:
    chart = _chart(sandbox, "plt.boxplot([[1, 2, 3, 4, 5], [2, 4, 6, 8, 10, 12, 40]], tick_labels=['a', 'b'],"
                            " patch_artist=True)")  # e2b_charts needs box patches
    assert isinstance(chart, BoxAndWhiskerChart)
    first, second = chart.elements
    assert first.label == "a" and first.min == 1 and first.median == 3 and first.max == 5
    assert second.label == "b" and second.max == 12 and second.outliers == [40]


def test_subplots_are_a_superchart(sandbox: Sandbox) -> None:
    chart = _chart(sandbox, "fig, (a, b) = plt.subplots(1, 2)\na.bar(['x', 'y'], [1, 2])\nb.plot([0, 1], [1, 0])\n"
                            "fig.suptitle('Both')")
    assert isinstance(chart, SuperChart) and chart.type == ChartType.SUPERCHART
    assert [c.type for c in chart.elements] == [ChartType.BAR, ChartType.LINE]


def test_saved_figure_shown_is_an_image(sandbox: Sandbox) -> None:
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2], [2, 1])\nplt.savefig('saved.png')\nplt.show()"
    )
    assert execution.error is None, execution.error
    pngs = [r.png for r in execution.results if r.png]
    assert len(pngs) == 1 and base64.b64decode(pngs[0]).startswith(PNG_MAGIC)
    # And the file was written, where the kernel runs (the sandbox user's home).
    assert sandbox.files.read("/home/user/saved.png", format="bytes")[:8] == PNG_MAGIC


def test_default_context_has_the_data_stack_loaded(new_sandbox: Callable[..., Sandbox]) -> None:
    sbx = new_sandbox()
    loaded = sbx.run_code("import sys\nsorted(m for m in ('numpy', 'pandas', 'matplotlib') if m in sys.modules)",
                          timeout=120)
    assert loaded.text == "['matplotlib', 'numpy', 'pandas']"
    # Contexts made on request start lean: nothing imported that the user did not ask for.
    ctx = sbx.create_code_context()
    assert sbx.run_code("import sys; 'pandas' in sys.modules", context=ctx).text == "False"


def test_first_execution_in_a_fresh_sandbox(new_sandbox: Callable[..., Sandbox]) -> None:
    sbx = new_sandbox()
    # At once after create: the data stack was imported at kernel start (warm.py), charts work.
    execution = sbx.run_code("import pandas as pd, matplotlib.pyplot as plt\n"
                             "plt.bar(['a'], [1])\nplt.show()\npd.DataFrame({'a': [1]})", timeout=120)
    assert execution.error is None, execution.error
    assert [r.chart.type for r in execution.results if r.chart] == [ChartType.BAR]
    assert execution.results[-1].data == {"a": [1]}


def test_chart_formatter_tolerates_half_imported_matplotlib(sandbox: Sandbox) -> None:
    # What user code sees while some import of matplotlib.figure is still under way.
    ctx = sandbox.create_code_context()
    try:
        sandbox.run_code("import sys, types\nsys.modules['matplotlib.figure'] = types.ModuleType('matplotlib.figure')",
                         context=ctx)
        execution = sandbox.run_code("[1, 2]", context=ctx)
        assert execution.error is None, execution.error
        assert execution.text == "[1, 2]"
    finally:
        sandbox.remove_code_context(ctx)
