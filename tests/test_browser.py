"""A learner's session in a real browser: JupyterLab started as `make lab` starts it,
driven in headless Chromium through Playwright.

Run it with `make test-browser`. It needs Chromium (Debian: `apt-get install
chromium`; or set CHROMIUM=/path/to/chrome) and Playwright's Python package
(`pip install playwright`; its own browser download is not needed). Without
them it is skipped, so `pytest tests` runs anywhere.

What it checks, in the order a learner meets it:

1. the landing page opens at the repository's root and links to chapter 01;
2. chapter 01 opens without turning "modified" (its metadata is what
   JupyterLab itself would write), and before any cell runs its widget cell
   already shows a picture of its output rather than `interactive(children=...`;
3. after Run All: rank output (`[rank 0] ...`), the live widget with its full
   labels, and the plots;
4. the lab's tab name says it is the lab; its first check shows the failure
   message (no traceback) on the stub, and a pass once the exercise is filled in.

Nothing is saved: autosave is off in the test's own JupyterLab settings, and
every settings and workspace folder is a temporary one.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import nbformat
import pytest

from tools import nbtool

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM, reason="no Chromium (apt-get install chromium, or set CHROMIUM)"),
    pytest.mark.timeout(600),
]

ROOT = pathlib.Path(__file__).resolve().parent.parent
# screenshots of each step, and the control notebook (inside the server's root; git ignores tmp/)
SHOTS = ROOT / "tmp" / "browser"
TOKEN = "course-browser-test"
SETTINGS = {  # the test's JupyterLab user settings
    # autosave off: running the notebooks here must not rewrite the committed files
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    # every cell in the DOM, so the test can find cells below the fold
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
}
RUN_ALL_S = 300  # chapter 01 runs in ~25 s on an idle laptop; a loaded 2-core CI box is slower


def _lab_args() -> list[str]:
    """LAB_ARGS as make expands it (the landing page depends on whether work/ has one),
    so this starts JupyterLab exactly as `make lab` does."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "lab-args"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.fixture(scope="module")
def lab_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jupyterlab")
    for name, value in SETTINGS.items():
        path = tmp / "user-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp / "user-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "jupyterlab", *_lab_args(), "--no-browser", f"--port={port}",
           "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers; a learner's `make lab` never runs as root
    log = open(tmp / "server.log", "w")
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (tmp / "server.log").read_text())
                time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def page(lab_url):
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.set_default_timeout(60_000)
        # `make lab` opens START_HERE.ipynb; the URL below is the one it prints
        pg.goto(f"{lab_url}/lab/tree/{nbtool.INDEX}?reset&token={TOKEN}")
        yield pg
        browser.close()


def _current_panel(pg):
    return pg.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")


def _wait_idle(pg, timeout_s: float) -> None:
    """Kernel idle and no cell waiting to run ('[*]')."""
    panel = _current_panel(pg)
    # the notebook toolbar's indicator (hidden on a narrow toolbar, but kept up to date)
    indicator = panel.locator(".jp-Notebook-ExecutionIndicator").first
    indicator.wait_for(state="attached", timeout=timeout_s * 1000)
    # the status bar names the kernel once it is connected: "Python 3 (ipykernel) | Idle"
    kernel = pg.locator(".jp-StatusBar-Widget", has_text="(ipykernel) | Idle").first
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = panel.locator(".jp-InputPrompt", has_text="[*]").count()
        status = indicator.get_attribute("data-status")
        if not busy and status == "idle" and kernel.count():
            return
        time.sleep(0.5)
    raise AssertionError(f"cells still running after {timeout_s} s")


def _cell(pg, index: int):
    return _current_panel(pg).locator(".jp-Notebook .jp-Cell").nth(index)


def _run_cell(pg, index: int, timeout_s: float = 120) -> str:
    cell = _cell(pg, index)
    cell.locator(".jp-InputArea-editor").click()
    pg.keyboard.press("Control+Enter")
    _wait_idle(pg, timeout_s)
    return cell.locator(".jp-Cell-outputArea").inner_text()


def _open_from_start_here(pg, text: str, href_part: str):
    link = pg.locator(f".jp-RenderedMarkdown a[href*='{href_part}']", has_text=text).first
    link.click()
    pg.locator(".lm-TabBar-tab.jp-mod-current", has_text=pathlib.Path(href_part).stem[:8]).wait_for()
    _wait_idle(pg, 120)  # kernel started


def test_landing_page_lists_chapters_at_the_repository_root(page):
    page.locator(".jp-RenderedMarkdown", has_text="start here").first.wait_for(timeout=120_000)
    md = page.locator(".jp-RenderedMarkdown").first.inner_text()
    for nb in sorted((ROOT / "course").glob("*.ipynb")):
        assert nb.stem[:2] in md
    # the file browser sits at the root: all three folders and helpers/ reachable
    names = page.locator(".jp-DirListing-itemName").all_inner_texts()
    for folder in ("course", "labs", "solutions", "helpers"):
        assert folder in names, f"{folder}/ not in the file browser: {names}"
    page.screenshot(path=str(SHOTS / "1_start_here.png"))


def _is_dirty_after_open(pg) -> bool:
    time.sleep(3)  # the kernel is connected; give JupyterLab time to write its metadata, if it would
    return "jp-mod-dirty" in (pg.locator(".lm-TabBar-tab.jp-mod-current").get_attribute("class") or "")


def test_a_notebook_with_old_metadata_turns_modified(page, lab_url):
    """The control for the next test: the dirty mark is seen when JupyterLab does rewrite
    (here the kernelspec's display name the course used to commit, "Python 3")."""
    old = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1", id="c0")])
    old.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    path = SHOTS / "old_metadata.ipynb"
    nbformat.write(old, path)
    rel = path.relative_to(ROOT).as_posix()
    page.goto(f"{lab_url}/lab/tree/{rel}?token={TOKEN}")
    _wait_idle(page, 120)
    assert _is_dirty_after_open(page)
    page.goto(f"{lab_url}/lab/tree/{nbtool.INDEX}?reset&token={TOKEN}")


def test_chapter_01_opens_unmodified_with_a_widget_picture(page):
    _open_from_start_here(page, "course", "course/01_why_distributed.ipynb")
    assert not _is_dirty_after_open(page), "opening chapter 01 marked it modified"
    # JupyterLab's own save writes back the same bytes (so a learner who only opens,
    # or saves without running anything, leaves git clean)
    path = ROOT / "course" / "01_why_distributed.ipynb"
    before, mtime = path.read_bytes(), path.stat().st_mtime_ns
    _current_panel(page).locator(".jp-Notebook").first.click()
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 30
    while path.stat().st_mtime_ns == mtime and time.monotonic() < deadline:
        time.sleep(0.2)
    assert path.stat().st_mtime_ns != mtime, "Ctrl+S did not save"
    assert path.read_bytes() == before, "saving from JupyterLab changed course/01 (see git diff)"
    widget_cell = _current_panel(page).locator(".jp-Cell", has_text="interact(show_budget")
    out = widget_cell.locator(".jp-Cell-outputArea").inner_text()
    assert "Run the cell to get the controls" in out and "interactive(children" not in out
    page.screenshot(path=str(SHOTS / "2_ch01_opened.png"))
    widget_cell.screenshot(path=str(SHOTS / "2_ch01_widget_before_run.png"))


def test_chapter_01_runs_with_ranks_widget_and_plots(page):
    panel = _current_panel(page)
    panel.locator(".jp-Notebook").first.click()
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    time.sleep(2)
    _wait_idle(page, RUN_ALL_S)
    text = panel.locator(".jp-Notebook").inner_text()
    assert "[rank 0] I am rank 0 of 4" in text and "[rank 3]" in text
    assert "Traceback" not in text, "a cell raised"
    widget_cell = panel.locator(".jp-Cell", has_text="interact(show_budget")
    widget_cell.locator(".widget-slider").first.wait_for()
    label = widget_cell.locator(".widget-label", has_text="params_billion").first
    assert label.evaluate("e => e.scrollWidth <= e.clientWidth"), "widget label is cut"
    pngs = panel.locator(".jp-RenderedImage img")
    assert pngs.count() >= 2, "the plots did not render"
    assert min(img.evaluate("e => e.naturalWidth") for img in pngs.all()) > 100
    page.screenshot(path=str(SHOTS / "3_ch01_run.png"))
    widget_cell.screenshot(path=str(SHOTS / "3_ch01_widget_live.png"))


def test_lab_check_fails_on_the_stub_and_passes_when_filled_in(page):
    page.locator(".lm-TabBar-tab", has_text="START_HERE").first.click()
    _open_from_start_here(page, "lab", "labs/01_why_distributed_lab.ipynb")
    tab_text = page.locator(".lm-TabBar-tab.jp-mod-current").get_attribute("title") or ""
    assert "_lab.ipynb" in tab_text, tab_text

    lab = nbformat.read(ROOT / "labs" / "01_why_distributed_lab.ipynb", as_version=4)
    sol = nbformat.read(ROOT / "solutions" / "01_why_distributed_solution.ipynb", as_version=4)
    ex = next(i for i, c in enumerate(lab.cells) if c.source.startswith("def bytes_per_param"))
    first_code = next(i for i, c in enumerate(lab.cells) if c.cell_type == "code")
    _run_cell(page, first_code)

    _run_cell(page, ex)
    failed = _run_cell(page, ex + 1)
    # the stub's message names the case it was called with
    assert "✗ check failed: bytes_per_param('fp32', 'adam') is not implemented yet" in failed, \
        failed
    assert "Traceback" not in failed and "helpers/checks" not in failed
    page.screenshot(path=str(SHOTS / "4_lab_check_failed.png"))

    answer = sol.cells[ex].source  # the same cell, solved (labs are generated cell by cell)
    assert answer.startswith("def bytes_per_param")
    editor = _cell(page, ex).locator(".jp-InputArea-editor")
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(answer)  # as pasted: no auto-indent, no auto-closed brackets
    _run_cell(page, ex)
    passed = _run_cell(page, ex + 1)
    assert passed.startswith("✓"), passed
    page.screenshot(path=str(SHOTS / "5_lab_check_passed.png"))
