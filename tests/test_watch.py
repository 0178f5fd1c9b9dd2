"""`phalanx watch`: the state it folds from a run's files, and the live page in headless Chromium during a run."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from phalanx import api
from phalanx.runs.watch import RunFollower, WatchState

SCREENSHOT = Path(__file__).resolve().parent.parent / "test-output" / "watch-page.png"


def test_follower_reads_complete_lines_and_marks_events(tmp_path):
    (tmp_path / "peers").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"preset": "x", "steps": 10}))
    rows = {0: [{"peer": "a", "step": s, "loss": 1.0 / (s + 1)} for s in range(6)],
            1: [{"peer": "b", "step": s, "loss": 1.0, "bans": [{"peer": "c", "step": 2, "reason": "gradient"}] if s == 2 else []}
                for s in (0, 1, 2, 5)],
            2: [{"peer": "c", "step": s, "loss": 9.0} for s in (0, 1)],
            3: [{"peer": "d", "step": s, "loss": 1.0} for s in (3, 4, 5)]}
    for index, recs in rows.items():
        (tmp_path / "peers" / f"{index}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with open(tmp_path / "peers" / "0.jsonl", "a") as f:
        f.write('{"peer": "a", "step": 6, "lo')  # a writer mid-line: not read yet
    follower = RunFollower(tmp_path)
    state = follower.poll().snapshot()
    assert state["steps_seen"] == 6 and state["records"] == 15 and not state["finished"]
    assert state["peers_per_step"] == [[0, 3], [1, 3], [2, 2], [3, 2], [4, 2], [5, 3]]
    events = {(e["kind"], e["peer"], e["step"], e["reason"]) for e in state["events"]}
    assert events == {("ban", 2, 2, "gradient"), ("crash", 1, 3, "left"), ("join", 1, 5, "came back"), ("join", 3, 3, "joined")}
    with open(tmp_path / "peers" / "0.jsonl", "a") as f:
        f.write('ss": 0.1}\n')
    assert follower.poll().snapshot()["steps_seen"] == 7


def test_pipeline_rows_fill_occupancy_outcomes_and_links():
    state = WatchState()
    state.config = {"kind": "pipeline", "preset": "p"}
    state.add(0, {"type": "iteration", "peer": "d", "it": 0, "loss": 2.0, "completed": 2,
                  "microbatches": [{"outcome": "ok"}, {"outcome": "ok"}, {"outcome": "deferred"}]})
    state.add(1, {"type": "event", "kind": "fwd", "peer": "r", "stage": 1, "it": 0, "t0": 0.0, "t1": 0.5})
    state.add(1, {"type": "event", "kind": "verdict", "peer": "r", "link": 1, "it": 0, "flagged": True})
    state.add(1, {"type": "event", "kind": "verdict", "peer": "r", "link": 1, "it": 0, "flagged": False})
    snap = state.snapshot()
    assert snap["loss"] == [[0, 2.0]] and snap["outcomes"] == {"deferred": [[0, 1]], "ok": [[0, 2]]}
    assert snap["occupancy"] == {"1": [[0, 0.5]]} and snap["links"] == [{"link": 1, "checked": 2, "flagged": 1}]
    assert snap["peers_per_step"] == [[0, 1]] and snap["link_flags"] == {"1": [[0, 1]]}


def chromium_or_skip() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("no browser: playwright is not installed (pip install -e '.[test]')")
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no browser: Debian's chromium is not installed (apt-get install chromium, as root)")
    return path


def test_watch_page_updates_during_a_run_in_headless_chromium(tmp_path):
    chromium = chromium_or_skip()
    pytest.importorskip("aiohttp", reason="the watch extra is not installed (pip install -e '.[watch]')")
    from playwright.sync_api import sync_playwright

    from phalanx.runs.watch import BackgroundWatch

    out = tmp_path / "run"
    watch = BackgroundWatch(out)
    config = api.config("btard-digits", peers=6, steps=50, set={"byzantine.count": 2, "byzantine.attack": "sign_flip",
                                                              "byzantine.start_step": 3, "train.eval_every": 5,
                                                              "faults.join": 1, "faults.join_after_step": 10})
    run = threading.Thread(target=api.simulate, args=(config, out))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1600, "height": 1300})
            page.goto(watch.url)
            page.wait_for_selector("#steps")
            assert page.inner_text("#steps") == "0"
            run.start()
            page.wait_for_function("+document.querySelector('#steps').textContent > 0 && "  # mid-run: more steps to come
                                   "+document.querySelector('#steps').textContent < 49", timeout=60_000)
            assert page.inner_text("#state") == "running"
            steps = int(page.inner_text("#steps"))
            points = int(page.get_attribute("#loss path.series", "data-n"))
            page.wait_for_function(f"+document.querySelector('#steps').textContent > {steps}", timeout=60_000)
            assert int(page.get_attribute("#loss path.series", "data-n")) > points  # the loss plot grew
            run.join()
            page.wait_for_function("document.querySelector('#state').textContent == 'finished'", timeout=60_000)
            assert page.inner_text("#steps") == "50" and page.inner_text("#nbanned") == "2"
            assert page.locator("#peers line.mark").count() >= 3  # the two bans and the join, marked
            assert "ban: gradient" in page.inner_text("#events") and "joined" in page.inner_text("#events")
            assert page.locator("#admission path.series").count() == 3  # trusted, untrusted, queued
            assert page.locator("#accuracy circle").count() == 10
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            browser.close()
    finally:
        if run.is_alive():
            run.join()
        watch.stop()
    print(f"watch page screenshot: {SCREENSHOT}")


def test_timeline_is_binned_to_stay_readable_at_256_peers_and_1000_steps(tmp_path):
    from phalanx.runs.dp.report import draw_timeline, timeline_bins

    timeline = [{"peer": p, "step": s, "t_start": float(s), "t_computed": s + 0.2, "t_end": s + 0.5}
                for p in range(256) for s in range(1000) if not (p < 2 and s < 2) and not (p == 255 and s >= 500)]
    presence, rows, cols, durations = timeline_bins(timeline, 256, 1000)
    assert presence.shape == (64, 250) and len(rows) == 65 and len(cols) == 251
    assert presence[0, 0] == pytest.approx(12 / 16)  # peers 0-3 x steps 0-3, four cells missing
    assert presence[-1, -1] == pytest.approx(3 / 4) and presence[5, 5] == 1.0  # peer 255 left at step 500
    assert durations == pytest.approx([0.5] * 250)
    ids = [f"p{i}" for i in range(256)]
    summary = {"peers": 256, "steps": 1000, "peer_ids": ids, "crashed": {"p255": 499}, "byzantine": ["p7"]}
    draw_timeline(tmp_path / "timeline.png", timeline, summary, [{"step": 300, "peer": "p7", "reason": "gradient"}], "t")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
