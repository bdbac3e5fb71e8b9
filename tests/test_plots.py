"""helpers.plots: one readable style, and widgets that show something before they run."""

import base64
import subprocess
import sys

import matplotlib
import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from helpers import plots

WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    yield sh
    InteractiveShell.clear_instance()


def test_style_is_sized_for_a_screen():
    with matplotlib.rc_context():
        plots.use()
        # matplotlib's defaults are 10 pt legends and 12 pt titles; the notebooks had 7-9 pt
        assert matplotlib.rcParams["legend.fontsize"] >= 11
        assert matplotlib.rcParams["axes.titlesize"] >= 14
        assert matplotlib.rcParams["legend.framealpha"] == 1.0


def test_ranks_do_not_import_matplotlib():
    """Outside a kernel (a rank, a script) `import helpers` leaves matplotlib alone:
    each rank would pay its import at start-up for nothing."""
    code = "import sys, helpers; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _shown(shell, fn, **controls):
    with capture_output() as cap:
        plots.interact(fn, **controls)
    assert len(cap.outputs) == 1, "one output: the widget and its picture in one bundle"
    return cap.outputs[0].data


def test_interact_adds_a_picture_of_a_plot(shell, monkeypatch):
    import matplotlib.pyplot as plt

    plt.close("all")
    monkeypatch.setattr(plt, "show", lambda: plt.close("all"))  # as the inline backend does

    def draw(n=3):
        plt.plot(range(n)); plt.show()

    data = _shown(shell, draw, n=(1, 10))
    assert WIDGET in data
    png = base64.b64decode(data["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.get_fignums(), "the snapshot's figure was left open (it would show twice)"


def test_interact_adds_the_printed_text_and_full_labels(shell):
    import ipywidgets

    def budget(params_billion=70.0, optimizer="adam"):
        print(f"{params_billion:.0f}B with {optimizer}")

    made = []
    real = ipywidgets.interactive

    def spy(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    ipywidgets.interactive = spy
    try:
        data = _shown(shell, budget, params_billion=(1.0, 500.0), optimizer=["adam", "sgd"])
    finally:
        ipywidgets.interactive = real
    assert WIDGET in data and data[WIDGET]["model_id"] == made[0].model_id
    assert "<pre>70B with adam\n</pre>" in data["text/html"]
    assert "image/png" not in data
    assert all(c.style.description_width == "initial" for c in made[0].kwargs_widgets)


def test_memory_calculator_shows_its_first_bar_before_it_runs(shell, monkeypatch):
    import matplotlib.pyplot as plt

    from helpers.memory import memory_widget

    monkeypatch.setattr(plt, "show", lambda: plt.close("all"))  # as the inline backend does
    with capture_output() as cap:
        memory_widget("70B (Llama 2)")
    bundles = [o.data for o in cap.outputs if WIDGET in o.data]
    assert len(bundles) == 1 and base64.b64decode(bundles[0]["image/png"])[:4] == b"\x89PNG"
