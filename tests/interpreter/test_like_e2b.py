"""What E2B's own code-interpreter suite expects and KeepState did differently (issue 28), each through the stock
e2b-code-interpreter SDK on a real sandbox: Java's env vars as system properties and its printed lines without their
newline; python and javascript listed as default contexts from the start; a PIL image shown, saved, or left as the
cell's value comes back as a PNG; a box plot drawn twice on one axes is one box-and-whisker chart; a sandbox killed
during run_code is reported as killed."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import BoxAndWhiskerChart, ChartType

from tests.interpreter.conftest import HOME

PIL_IMAGE = "import numpy\nfrom PIL import Image\n" \
            "image = Image.fromarray((numpy.random.rand(8, 8, 3) * 255).astype('uint8')).convert('RGBA')\n"


def test_java_env_vars_are_system_properties_and_lines_come_without_newline(
        new_sandbox: Callable[..., Sandbox]) -> None:
    sbx = new_sandbox(envs={"KS_SANDBOX_VAR": "from create"})
    assert sbx.run_code('System.getProperty("KS_SANDBOX_VAR")', language="java", timeout=240).text == "from create"
    once = sbx.run_code('System.getProperty("KS_SANDBOX_VAR")', language="java", envs={"KS_SANDBOX_VAR": "once"})
    assert once.text == "once"
    assert sbx.run_code('System.getProperty("KS_SANDBOX_VAR")', language="java").text == "from create"
    per_run = sbx.run_code('System.getProperty("KS_ONLY_NOW")', language="java", envs={"KS_ONLY_NOW": "x"})
    assert per_run.text == "x"
    assert sbx.run_code('System.getProperty("KS_ONLY_NOW", "unset")', language="java").text == "unset"
    assert sbx.run_code('System.out.println("Hello, World!")', language="java").logs.stdout == ["Hello, World!"]


def test_python_and_javascript_are_listed_from_the_start(new_sandbox: Callable[..., Sandbox]) -> None:
    sbx = new_sandbox()
    listed = sbx.list_code_contexts()
    assert sorted(c.language for c in listed) == ["javascript", "python"]
    js = next(c for c in listed if c.language == "javascript")
    # The listed JavaScript context is the default one: its kernel starts on this first use, by id or by language.
    assert sbx.run_code("const listedDefault = 41", context=js, timeout=240).error is None
    assert sbx.run_code("listedDefault + 1", language="javascript").text == "42"
    made = sbx.create_code_context()  # no options: a Python context in the user's home, listed last
    last = sbx.list_code_contexts()[-1]
    assert (last.id, last.language, last.cwd) == (made.id, "python", HOME)


@pytest.mark.parametrize("how", ["show", "save", "value"])
def test_a_pil_image_comes_back_as_a_png(sandbox: Sandbox, how: str) -> None:
    code = PIL_IMAGE + {"show": "image.show()\nprint('shown')", "save": "image.save('ks.png')\nprint('saved')",
                        "value": "image"}[how]
    execution = sandbox.run_code(code)
    assert execution.error is None, execution.error
    assert execution.results and execution.results[0].png


def test_a_box_plot_drawn_twice_is_one_chart(sandbox: Sandbox) -> None:
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\n"
        "scores = {'A': [85, 90, 78, 92, 88], 'B': [95, 89, 76, 91, 84, 87], 'C': [75, 82, 88, 79, 86]}\n"
        "fig, ax = plt.subplots()\n"
        "ax.boxplot(scores.values(), tick_labels=scores.keys())\n"
        "ax.set_title('Scores'); ax.set_xlabel('Class'); ax.set_ylabel('Score')\n"
        "ax.boxplot(scores.values(), tick_labels=scores.keys(), patch_artist=True)\n"
        "plt.show()")
    assert execution.error is None, execution.error
    chart = execution.results[0].chart
    assert isinstance(chart, BoxAndWhiskerChart) and chart.type == ChartType.BOX_AND_WHISKER
    assert (chart.title, chart.x_label, chart.y_label) == ("Scores", "Class", "Score")
    assert [b.label for b in chart.elements] == ["A", "B", "C"]
    first = chart.elements[0]
    assert (first.min, first.first_quartile, first.median, first.third_quartile, first.max) == (78, 85, 88, 90, 92)


def test_a_sandbox_killed_during_run_code_is_reported_as_killed(new_sandbox: Callable[..., Sandbox]) -> None:
    sbx = new_sandbox()
    assert sbx.run_code("1").text == "1"
    timer = threading.Timer(2.0, sbx.kill)
    timer.start()
    try:
        with pytest.raises(TimeoutException, match="sandbox was killed while the request was in progress"):
            sbx.run_code("import time; time.sleep(60)")
    finally:
        timer.cancel()
